"""The controller's parts on known data: the policy's controller sections and their contradictions, the statistics
its verdicts use, the window arithmetic on scrapes, the drift tests (rate, mean lengths, length distributions), the
guardrails and the decision log's resume (the canary's switchback: test_control_canary.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from slotune.slo import SLO
from policies import PolicyError, load_policy, parse_policy
from policies.control import ControlSpec
from tuner.control.decision_log import DecisionLog, read_log, resume
from tuner.control.guardrails import changed, cooldown_left, move_policy, project, within
from engine.metrics import LENGTH_BUCKETS
from tuner.control.shape import Shape
from tuner.control.sources import Scrape
from tuner.control.candidates import Prediction, Search
from tuner.control.loop import service_time
from tuner.control.window import CounterReset, Lengths, WindowStats, lengths_between, off_bucket_targets, window
from tuner.measure.statistics import (
    proportion_difference_interval,
)

DEFAULT = yaml.safe_load(Path("policies/default.yaml").read_text())


def policy_with(**sections: Any) -> Any:
    return parse_policy({**DEFAULT, **sections})


# Policy ------------------------------------------------------------------------------------------------------------
def test_the_shipped_policy_has_the_controller_sections() -> None:
    control = load_policy().control
    assert control.triggers.attainment_target == 0.9 and control.canary.lease_s == 2 * control.canary.block + \
        control.canary.lease_margin
    assert control.guardrails.frozen == ("block_size",) and control.guardrails.cooldown > 0


@pytest.mark.parametrize("sections, field", [
    ({"guardrails": {"bounds": {"max_num_seqs": {"low": 32, "high": 64}}}}, "guardrails.bounds.max_num_seqs"),
    ({"guardrails": {"bounds": {"max_num_seqs": {"low": 8, "high": 4}}}}, "guardrails.bounds.max_num_seqs.low"),
    ({"guardrails": {"frozen": ["block_size"], "max_change": {"block_size": 2}}}, "guardrails.max_change.block_size"),
    ({"guardrails": {"frozen": ["block_size"], "bounds": {"block_size": {"low": 8, "high": 16}}}},
     "guardrails.bounds.block_size"),
    ({"guardrails": {"frozen": ["max_num_seqs", "max_num_batched_tokens", "chunk_size", "block_size"]}},
     "guardrails.frozen"),
    ({"guardrails": {"bounds": {"preemption_mode": {"low": 1, "high": 2}}}}, "guardrails.bounds.preemption_mode"),
    ({"guardrails": {"max_change": {"max_num_seqs": 0.5}}}, "guardrails.max_change.max_num_seqs"),
    ({"canary": {"block": "10s", "settle": "10s"}}, "canary.settle"),
    ({"canary": {"block": "20s", "max_window": "3m"}}, "canary.max_window"),
    ({"triggers": {"attainment_target": 1.5}}, "triggers.attainment_target"),
    ({"triggers": {"windw": "10s"}}, "triggers.windw"),
    ({"retune": {"candidates": 0}}, "retune.candidates"),
])
def test_contradictory_or_bad_controller_fields_name_the_field(sections: dict[str, Any], field: str) -> None:
    with pytest.raises(PolicyError) as error:
        policy_with(**sections)
    assert error.value.field == field, str(error.value)


@pytest.mark.parametrize("sections, field, words", [
    ({"guardrails": 3}, "guardrails", "mapping"),
    ({"canary": ["block"]}, "canary", "mapping"),
    ({"guardrails": {"bounds": {5: {"low": 1, "high": 2}}}}, "guardrails.bounds.5", "strings"),
    ({"guardrails": {"bounds": {"max_num_seqs": {"low": 2}}}}, "guardrails.bounds.max_num_seqs.high", "required"),
    ({"guardrails": {"bounds": {"max_num_seqs": {"low": 2, "high": 8, "mid": 4}}}},
     "guardrails.bounds.max_num_seqs.mid", "unknown field"),
    ({"guardrails": {"bounds": {"max_num_seqs": {"low": -1, "high": 8}}}}, "guardrails.bounds.max_num_seqs.low",
     ">= 0"),
    ({"guardrails": {"bounds": {"max_num_seqs": {"low": "two", "high": 8}}}}, "guardrails.bounds.max_num_seqs.low",
     "number"),
    ({"guardrails": {"bounds": {"block_size": {"low": 9, "high": 15}}, "frozen": []}}, "guardrails.bounds.block_size",
     "leaves no value"),
    ({"guardrails": {"bounds": {"block_size": {"low": 8, "high": 16}}}}, "guardrails.bounds.block_size",
     "frozen by default"),
    ({"guardrails": {"bounds": "max_num_seqs"}}, "guardrails.bounds", "mapping"),
    ({"guardrails": {"frozen": "block_size"}}, "guardrails.frozen", "list"),
    ({"guardrails": {"frozen": ["block_size", "blocks"]}}, "guardrails.frozen[1]", "unknown knob"),
    ({"guardrails": {"max_change": {"max_seqs": 2}}}, "guardrails.max_change.max_seqs", "unknown knob"),
    ({"guardrails": {"max_change": {"max_num_seqs": 1}}}, "guardrails.max_change.max_num_seqs", "> 1"),
    ({"guardrails": {"max_change": {"max_num_seqs": float("inf")}}}, "guardrails.max_change.max_num_seqs", "finite"),
    ({"guardrails": {"max_change": {"max_num_seqs": True}}}, "guardrails.max_change.max_num_seqs", "number"),
    ({"guardrails": {"default_max_change": 0.9}}, "guardrails.default_max_change", "> 1"),
    ({"guardrails": {"cooldown": "soon"}}, "guardrails.cooldown", "not a duration"),
    ({"guardrails": {"cooldown": -5}}, "guardrails.cooldown", "not a duration"),
    ({"guardrails": {"cool_down": "5s"}}, "guardrails.cool_down", "unknown field"),
    ({"triggers": {"attainment_target": 0}}, "triggers.attainment_target", "> 0"),
    ({"triggers": {"window": "0s"}}, "triggers.window", "> 0"),
    ({"triggers": {"min_requests": 0}}, "triggers.min_requests", ">= 1"),
    ({"triggers": {"min_requests": 2.5}}, "triggers.min_requests", "integer"),
    ({"triggers": {"drift_threshold": 0}}, "triggers.drift_threshold", "> 0"),
    ({"triggers": {"drift_window": "later"}}, "triggers.drift_window", "not a duration"),
    ({"triggers": {"schedule": "0s"}}, "triggers.schedule", "> 0"),
    ({"canary": {"block": 0}}, "canary.block", "> 0"),
    ({"canary": {"level": 0.6}}, "canary.level", "< 0.5"),
    ({"canary": {"power": 1}}, "canary.power", "< 1"),
    ({"canary": {"min_effect": 0}}, "canary.min_effect", "> 0"),
    ({"canary": {"block": "20s", "max_window": "3m"}}, "canary.max_window", "at least 7 pairs"),
    ({"canary": {"min_window": "20s"}}, "canary.min_window", "unknown field"),
    ({"canary": {"max_window": "never"}}, "canary.max_window", "not a duration"),
    ({"canary": {"lease_margin": 0}}, "canary.lease_margin", "> 0"),
    ({"canary": {"rollback_drop": 1.5}}, "canary.rollback_drop", "<= 1"),
    ({"canary": {"rollback_drop": -0.1}}, "canary.rollback_drop", ">= 0"),
    ({"canary": {"window": "1m"}}, "canary.window", "unknown field"),
    ({"retune": {"headroom": 0.5}}, "retune.headroom", ">= 1"),
    ({"retune": {"candidates": 4.5}}, "retune.candidates", "integer"),
    ({"retune": {"sim_duration": 0}}, "retune.sim_duration", "> 0"),
    ({"retune": {"step_history": "long"}}, "retune.step_history", "not a duration"),
    ({"retune": {"budget": 3}}, "retune.budget", "unknown field"),
])
def test_every_controller_check_names_its_field(sections: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(PolicyError) as error:
        policy_with(**sections)
    assert error.value.field == field, str(error.value)
    assert words in str(error.value), str(error.value)


def test_controller_sections_parse_to_their_values() -> None:
    control = policy_with(
        guardrails={"bounds": {"max_num_seqs": {"low": 2, "high": 12}}, "max_change": {"chunk_size": 4},
                    "default_max_change": 1.5, "frozen": ["block_size"], "cooldown": "1m30s"},
        triggers={"attainment_target": 0.95, "window": "2m", "min_requests": 10, "drift_threshold": 0.5,
                  "drift_window": "45s", "schedule": "1h"},
        canary={"block": "15s", "settle": "3s", "level": 0.05, "power": 0.9, "min_effect": 0.2, "max_window": "10m",
                "lease_margin": "10s", "rollback_drop": 0.2},
        retune={"candidates": 16, "headroom": 1.5, "sim_duration": "20s", "step_history": "10m"}).control
    g = control.guardrails
    assert g.bounds == {"max_num_seqs": (2.0, 12.0)} and g.max_change == {"chunk_size": 4.0}
    assert g.change_limit("chunk_size") == 4.0 and g.change_limit("max_num_seqs") == 1.5
    assert g.frozen == ("block_size",) and g.cooldown == 90.0
    t = control.triggers
    assert (t.attainment_target, t.window, t.min_requests, t.drift_threshold, t.drift_window, t.schedule) == \
        (0.95, 120.0, 10, 0.5, 45.0, 3600.0)
    c = control.canary
    assert (c.block, c.settle, c.level, c.power, c.min_effect, c.max_window, c.lease_margin, c.rollback_drop,
            c.lease_s) == (15.0, 3.0, 0.05, 0.9, 0.2, 600.0, 10.0, 0.2, 40.0)
    r = control.retune
    assert (r.candidates, r.headroom, r.sim_duration, r.step_history) == (16, 1.5, 20.0, 600.0)
    assert isinstance(t.min_requests, int) and isinstance(r.candidates, int)


def test_empty_controller_sections_are_the_defaults() -> None:
    empty = policy_with(guardrails=None, triggers={}, canary=None, retune={}).control
    assert empty == ControlSpec()
    assert empty.guardrails.bounds == {} and empty.guardrails.frozen == ("block_size",)
    assert empty.triggers.schedule is None and policy_with(guardrails={}).control.guardrails == empty.guardrails
    assert empty.guardrails.cooldown == 60.0 and empty.canary.lease_s == 70.0 and empty.retune.candidates == 48


# Statistics --------------------------------------------------------------------------------------------------------
def test_difference_of_shares_matches_newcombes_published_example() -> None:
    # Newcombe (1998), Statistics in Medicine 17:873, table II example (56/70 vs 48/80): method 10 gives 0.0524-0.3339
    d = proportion_difference_interval(56, 70, 48, 80)
    assert d.value == pytest.approx(0.2)
    assert d.low == pytest.approx(0.0524, abs=5e-4) and d.high == pytest.approx(0.3339, abs=5e-4)


def test_difference_of_shares_covers_the_truth_at_its_level() -> None:
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(400):
        a, b = rng.binomial(60, 0.9), rng.binomial(60, 0.7)
        d = proportion_difference_interval(int(a), 60, int(b), 60)
        hits += d.low <= 0.2 <= d.high
    assert hits / 400 >= 0.92


# Windows -----------------------------------------------------------------------------------------------------------
def scrape(t: float, *, ok: float, count: float, finished: float, prompt: float = 0.0, output: float = 0.0,
           generation: int = 1, waiting: float = 0.0, ttft_ok: float | None = None,
           first_tokens: float | None = None, e2e_ok: float | None = None) -> Scrape:
    values = {("slotune_request_itl_p99_seconds_bucket", (("le", "0.04"),)): ok * 0.9,
              ("slotune_request_itl_p99_seconds_bucket", (("le", "0.05"),)): ok,
              ("slotune_request_itl_p99_seconds_bucket", (("le", "0.06"),)): count,
              ("slotune_request_itl_p99_seconds_count", ()): count,
              ("slotune_request_success_total", (("finished_reason", "length"),)): finished,
              ("slotune_request_success_total", (("finished_reason", "abort"),)): 0.0,
              ("slotune_prompt_tokens_total", ()): prompt, ("slotune_generation_tokens_total", ()): output,
              ("slotune_config_generation", ()): float(generation), ("slotune_num_requests_waiting", ()): waiting}
    if ttft_ok is not None:
        values[("slotune_time_to_first_token_seconds_bucket", (("le", "2.0"),))] = ttft_ok
        values[("slotune_time_to_first_token_seconds_count", ())] = count if first_tokens is None else first_tokens
    if e2e_ok is not None:
        values[("slotune_e2e_request_latency_seconds_bucket", (("le", "10.0"),))] = e2e_ok
        values[("slotune_e2e_request_latency_seconds_count", ())] = finished
    return Scrape(t, values)


def test_attainment_is_the_bucket_at_the_target_over_all_finished_requests() -> None:
    w = window(scrape(0, ok=10, count=10, finished=10), scrape(30, ok=55, count=60, finished=62, prompt=1040,
                                                               output=520, waiting=3), SLO(tbt_p99=0.05))
    assert (w.finished, w.attaining) == (52, 45)  # two aborted-or-unmeasured requests do not attain
    assert w.attainment.value == pytest.approx(45 / 52) and w.attainment.low < 45 / 52 < w.attainment.high
    assert w.arrived == 55 and w.arrival_rate == pytest.approx(55 / 30) and w.mean_prompt == pytest.approx(20)
    # a target between bucket bounds reads the bound below it (only requests sure to attain)
    assert window(scrape(0, ok=0, count=0, finished=0), scrape(1, ok=10, count=10, finished=10),
                  SLO(tbt_p99=0.045)).attaining == 9
    # with a TTFT target: finished less the larger of the two targets' misses
    both = window(scrape(0, ok=0, count=0, finished=0, ttft_ok=0), scrape(1, ok=10, count=10, finished=10,
                                                                             ttft_ok=4), SLO(tbt_p99=0.05,
                                                                                             ttft_p99=2.0))
    assert both.attaining == 4
    # a window in which more requests finish than start (a queue draining): the TTFT histogram saw 4 first tokens,
    # all within the target, and 10 requests finished within TBT: none missed, all 10 attain (not 4)
    drained = window(scrape(0, ok=0, count=0, finished=0, ttft_ok=0, first_tokens=0),
                     scrape(1, ok=10, count=10, finished=10, ttft_ok=4, first_tokens=4), SLO(tbt_p99=0.05,
                                                                                             ttft_p99=2.0))
    assert drained.attaining == 10 and (drained.missed_tbt, drained.missed_ttft) == (0, 0)
    # and where 2 of those 4 first tokens missed, 2 of the finished requests are taken as missed
    late = window(scrape(0, ok=0, count=0, finished=0, ttft_ok=0, first_tokens=0),
                  scrape(1, ok=10, count=10, finished=10, ttft_ok=2, first_tokens=4), SLO(tbt_p99=0.05, ttft_p99=2.0))
    assert late.attaining == 8


def test_an_e2e_target_is_judged_with_the_others(tmp_path: Path) -> None:
    from tuner.control.attainment import Counts, merged
    from tuner.control.loop import Controller

    # 10 requests finished within the TBT and TTFT targets, 3 of them past the 10 s end-to-end target: 7 attain
    before = scrape(0, ok=0, count=0, finished=0, ttft_ok=0, e2e_ok=0)
    after = scrape(1, ok=10, count=10, finished=10, ttft_ok=10, e2e_ok=7)
    w = window(before, after, SLO(tbt_p99=0.05, ttft_p99=2.0, e2e_p99=10.0))
    assert (w.attaining, w.missed_e2e) == (7, 3)
    assert window(before, after, SLO(tbt_p99=0.05, ttft_p99=2.0)).attaining == 10  # no E2E target: not judged
    # the attainment monitor's looks count them too, and the controller judges the policy's whole SLO
    assert merged([Counts(1.0, 10, 0.0, 0.0, 3.0), Counts(1.0, 10, 1.0, 2.0, 0.0)]).attaining == 17
    controller = Controller(policy_with(slo={"tbt_p99": "50ms", "e2e_p99": "10s"}), None, None,
                            DecisionLog(tmp_path / "c.jsonl"), say=lambda s: None)
    assert controller.slo == SLO(tbt_p99=0.05, ttft_p99=2.0, e2e_p99=10.0)  # the TTFT target kept from the default
    assert off_bucket_targets(after, SLO(tbt_p99=0.05, e2e_p99=12.0))[0].startswith("the E2E target 12.00s")


def test_a_counter_that_went_down_means_a_restart() -> None:
    with pytest.raises(CounterReset):
        window(scrape(0, ok=50, count=50, finished=50), scrape(10, ok=3, count=3, finished=3), SLO(tbt_p99=0.05))


BOUNDS = (*map(float, LENGTH_BUCKETS), math.inf)


def cumulative(name: str, lengths: list[int]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A length histogram of these requests as the engine exports it (cumulative buckets, `le` as it spells it)."""
    values = {(f"{name}_bucket", (("le", "+Inf" if math.isinf(b) else str(b)),)): float(sum(k <= b for k in lengths))
              for b in BOUNDS}
    values[(f"{name}_sum", ())] = float(sum(lengths))
    return values


def test_a_window_reads_the_length_histograms_of_the_requests_that_finished_in_it() -> None:
    early, late = [3, 12, 40], [3, 12, 40, 7, 300, 300, 25000]
    before = Scrape(0, cumulative("slotune_request_prompt_tokens", early))
    after = Scrape(10, cumulative("slotune_request_prompt_tokens", late))
    got = lengths_between(before, after, "slotune_request_prompt_tokens")
    assert got.bounds == BOUNDS and got.n == 4 and got.total == 7 + 300 + 300 + 25000
    assert dict(zip(got.bounds, got.counts)) == {**dict.fromkeys(BOUNDS, 0.0), 10.0: 1.0, 500.0: 2.0, math.inf: 1.0}
    assert got.as_dict()["buckets"] == {"10": 1, "500": 2, "+Inf": 1}
    # consecutive windows add up to the window over both
    middle = Scrape(5, cumulative("slotune_request_prompt_tokens", late[:5]))
    assert lengths_between(before, middle, "slotune_request_prompt_tokens") + \
        lengths_between(middle, after, "slotune_request_prompt_tokens") == got
    # a source without the histograms gives no lengths; one whose buckets went down, a restart
    assert lengths_between(before, after, "slotune_request_generation_tokens") == Lengths()
    with pytest.raises(CounterReset):
        lengths_between(after, before, "slotune_request_prompt_tokens")


# Guardrails --------------------------------------------------------------------------------------------------------
def test_one_move_stays_within_bounds_change_limits_and_frozen_knobs() -> None:
    p = policy_with(guardrails={"bounds": {"max_num_seqs": {"low": 2, "high": 12}}, "max_change": {"max_num_seqs": 2},
                                "frozen": ["block_size"], "default_max_change": 4})
    current = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "chunk_size": 32, "block_size": 16}
    moved = move_policy(p, current)
    seqs = moved.knob("max_num_seqs")
    assert (seqs.low, seqs.high) == (4, 12) and moved.fixed["block_size"] == 16
    assert set(moved.knob("max_num_batched_tokens").choices or ()) == {16, 32, 64, 128, 256}
    assert within({**current, "max_num_seqs": 16}, current, p) is not None  # 2x but above the bound 12
    assert "frozen" in (within({**current, "block_size": 32}, current, p) or "")
    assert within({**current, "max_num_seqs": 12, "max_num_batched_tokens": 256}, current, p) is None
    far = project({"max_num_seqs": 1, "max_num_batched_tokens": 16, "chunk_size": 8, "block_size": 8}, moved)
    assert far["max_num_seqs"] == 4 and far["block_size"] == 16 and within(far, current, p) is None
    assert changed(far, current) and cooldown_left(100.0, 90.0, p.control.guardrails) == pytest.approx(50.0)


def test_a_config_outside_the_space_moves_toward_it_no_further_than_the_limit() -> None:
    p = policy_with(guardrails={"default_max_change": 2})
    moved = move_policy(p, {"max_num_seqs": 64, "max_num_batched_tokens": 512, "chunk_size": None, "block_size": 16},
                        {"chunk_size": 512})
    assert (moved.knob("max_num_seqs").low, moved.knob("max_num_seqs").high) == (32, 32)
    assert moved.knob("max_num_batched_tokens").choices == (256,) and moved.fixed["chunk_size"] is None


# Decision log ------------------------------------------------------------------------------------------------------
def test_resume_continues_ids_and_closes_an_open_canary_once(tmp_path: Path) -> None:
    log = DecisionLog(tmp_path / "c.jsonl")
    log.write("decision", id=1, outcome="no_move")
    log.write("canary", id=2, generation=5, kept_knobs={"max_num_seqs": 4}, trigger={"kind": "drift"})
    with open(tmp_path / "c.jsonl", "a") as f:
        f.write('{"kind": "decision", "id": 2, "outc')  # cut short by kill -9
    state = resume(read_log(tmp_path / "c.jsonl"))
    assert state.next_id == 3 and state.open_canary is not None and state.open_canary["id"] == 2
    log.write("decision", id=2, outcome="abandoned")
    assert resume(read_log(tmp_path / "c.jsonl")).open_canary is None
    assert [json.loads(line)["kind"] for line in (tmp_path / "c.jsonl").read_text().splitlines()
            if line.endswith("}")][-1] == "decision"


def test_a_rate_shift_long_after_the_start_is_drift_even_at_a_rate_too_low_for_one_window(tmp_path: Path) -> None:
    """At 0.4 req/s one 30 s drift window holds 12 requests, fewer than the 20 a look needs: looks span two windows,
    the reference is kept after its scrapes leave the controller's history, and the rate quadrupling five minutes
    in is drift within a few looks; nothing before it is."""
    from tuner.control.loop import Controller

    policy = policy_with(triggers={"drift_window": "30s", "min_requests": 20, "drift_threshold": 0.3,
                                   "drift_reference": "2m"})
    controller = Controller(policy, None, None, DecisionLog(tmp_path / "c.jsonl"), say=lambda s: None)
    finished, fired_at = 0.0, None
    for t in range(0, 601, 2):
        finished += (0.4 if t < 300 else 1.6) * 2
        controller.remember(scrape(float(t), ok=finished, count=finished, finished=finished,
                                   prompt=20 * finished, output=20 * finished))
        alarm = controller.drift_look(float(t))
        assert alarm is None or t > 300, (t, alarm)
        if alarm is not None and fired_at is None:
            fired_at = t
            assert alarm["quantity"] == "arrival_rate" and alarm["direction"] == "up"
    assert controller.history[0].time > 100  # the reference's scrapes are long gone
    assert fired_at is not None and fired_at <= 300 + 120, fired_at
    assert controller.drift.reference is not None and controller.drift.reference.requests >= 20


def test_at_a_rate_too_low_for_one_trigger_window_the_attainment_trigger_merges_windows(tmp_path: Path) -> None:
    """At 0.4 req/s a 30 s window holds 12 finished requests, fewer than the 20 a look needs: a config that attains
    half its requests was never judged (a 20-minute run at 60 % attainment made no decision). The looks merge two
    windows, and the shortfall alarms once it has lasted two looks, no sooner."""
    from tuner.control.loop import Controller
    from tuner.control.triggers import attainment_trigger

    policy = policy_with(triggers={"window": "30s", "min_requests": 20})
    controller = Controller(policy, None, None, DecisionLog(tmp_path / "c.jsonl"), say=lambda s: None)
    finished, alarm, fired_at = 0.0, None, None
    for t in range(0, 361, 2):
        finished += 0.4 * 2
        controller.remember(scrape(float(t), ok=finished / 2, count=finished, finished=finished))
        alarm = controller.attainment_look(float(t))
        if alarm is not None:
            fired_at = t
            break
    # two looks of two windows each: no alarm before two minutes of the shortfall
    assert fired_at is not None and 120 <= fired_at <= 240, fired_at
    assert alarm is not None and alarm["look"]["finished"] >= 20 and alarm["looks"] >= 2
    stats = controller.trigger_window()
    assert stats is not None
    trigger = attainment_trigger(alarm, stats, policy.control.triggers)
    assert trigger.kind == "attainment" and "stayed below the target 90%" in trigger.reason


def test_a_look_counts_a_request_whose_first_token_and_finish_fall_in_different_scrape_intervals(
        tmp_path: Path) -> None:
    """The TTFT histogram counts a request at its first token, the finish counter seconds later, so per 2 s scrape
    interval the two rarely line up. A look that clipped each interval's attaining count to its finished requests
    and summed them read 10 of 21 where all 21 attained, and fired the trigger on traffic that attained 100 %."""
    from tuner.control.attainment import Counts, merged
    from tuner.control.loop import Controller

    rng = np.random.default_rng(5)
    arrivals = np.cumsum(rng.exponential(1.0, 1300))  # 1 req/s for 20 minutes
    first = arrivals + rng.uniform(0.1, 0.5, arrivals.size)
    done = first + rng.uniform(1.0, 8.0, arrivals.size)  # every request attains both targets
    policy = policy_with(triggers={"window": "60s"})
    controller = Controller(policy, None, None, DecisionLog(tmp_path / "c.jsonl"), say=lambda s: None)
    assert controller.slo.ttft_p99 == 2.0
    for t in range(0, 1201, 2):
        finished, started = float((done <= t).sum()), float((first <= t).sum())
        controller.remember(scrape(float(t), ok=finished, count=finished, finished=finished, ttft_ok=started,
                                   first_tokens=started))
        assert controller.attainment_look(float(t)) is None, t
    intervals = controller.intervals_between(1140.0, 1200.0)
    assert intervals is not None
    # per interval too, nothing is lost: each interval's attaining count is its finished requests less its misses
    assert sum(w.attaining for w in intervals) == sum(w.finished for w in intervals)
    look = merged([Counts(w.seconds, w.finished, w.missed_tbt, w.missed_ttft) for w in intervals])
    assert look.finished > 40 and look.attaining == look.finished
    assert controller.attainment.looks >= 15 and controller.attainment.cusum == 0.0


def test_the_retune_workload_follows_the_live_length_histograms() -> None:
    from loadtest.workloads import open_workload
    from tuner.control.candidates import live_workload

    bounds = tuple(float(b) for b in LENGTH_BUCKETS) + (math.inf,)

    def lengths(filled: dict[float, int], total: float) -> Lengths:
        return Lengths(bounds, tuple(float(filled.get(b, 0)) for b in bounds), total)

    prompts = lengths({20: 30, 200: 10}, 30 * 16 + 10 * 150)  # 75 % short prompts, 25 % of 101-200 tokens
    outputs = lengths({50: 40}, 40 * 30)
    assert prompts.ranges() == [(11, 20, 30.0), (101, 200, 10.0)]
    shape = Shape(seconds=60.0, requests=40, prompt_means=(), output_means=(), prefix_hit_rate=0.0,
                  prompt_lengths=prompts, output_lengths=outputs)
    spec = live_workload(shape)
    assert spec.mix == "p0o0=11-20:21-50,p1o0=101-200:21-50" and spec.mix_weights == "75:25"
    workload = open_workload("mixed", mix=spec.mix or "", mix_weights=spec.mix_weights or "")
    drawn = [r for _, r in zip(range(400), workload.specs())]
    short = sum(11 <= r.prompt_len <= 20 for r in drawn)
    assert short == 300 and all(101 <= r.prompt_len <= 200 for r in drawn if r.prompt_len > 20)
    assert all(21 <= r.output_len <= 50 for r in drawn)
    # without histograms (a source that only counts tokens): one class around the means
    plain = Shape(seconds=60.0, requests=40, prompt_means=(100.0,), output_means=(20.0,), prefix_hit_rate=0.0)
    assert live_workload(plain).mix == "live=50-150:10-30"


class IdleEngine:
    """An engine running two sequences, with no steps recorded and no other lease: what a retune reads."""

    def __init__(self) -> None:
        self.applied: list[dict[str, Any]] = []

    def admin_config(self) -> dict[str, Any]:
        return {"config": {"max_num_seqs": 2}, "generation": 1, "resolved": {}, "lease": None}

    def steps(self, since: int) -> tuple[list[dict[str, Any]], int]:
        return [], 0

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "dtype": "float32"}

    def apply(self, knobs: dict[str, Any], lease_s: float | None = None) -> dict[str, Any]:
        self.applied.append(knobs)
        return {"generation": 2}


def retune_on_a_trigger(tmp_path: Path, engine: IdleEngine) -> tuple[Any, list[dict[str, Any]]]:
    """A controller that has watched a minute of traffic acts on an attainment trigger: it and its decisions."""
    from tuner.control.loop import Controller
    from tuner.control.triggers import Trigger

    controller = Controller(policy_with(), None, engine, DecisionLog(tmp_path / "c.jsonl"), say=lambda s: None)
    for t in range(0, 62, 2):
        controller.remember(scrape(float(t), ok=t / 4, count=t, finished=t, prompt=20 * t, output=20 * t))
    before = controller.trigger_window()
    assert before is not None
    controller.act(Trigger("attainment", "below target", {}), before)
    return controller, [r for r in read_log(tmp_path / "c.jsonl") if r["kind"] == "decision"]


def test_a_retune_that_fails_is_a_logged_no_move_and_the_controller_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tuner.control.loop as loop

    def broken_search(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("the simulator cannot parse the rebuilt workload")

    monkeypatch.setattr(loop, "search", broken_search)
    engine = IdleEngine()
    controller, decisions = retune_on_a_trigger(tmp_path, engine)
    assert len(decisions) == 1 and decisions[0]["outcome"] == "no_move"
    assert "the retune failed: ValueError: the simulator cannot parse" in decisions[0]["reason"]
    assert engine.applied == [] and controller.canary is None  # nothing applied; the next tick watches again


def test_the_retune_searches_on_its_own_thread_at_the_lowest_cpu_priority(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's steps come before the controller's simulator search where the two share cores; the loop's own
    thread keeps its priority (it scrapes and judges canaries on time)."""
    import os
    import threading

    import tuner.control.loop as loop

    def own_niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen: dict[str, Any] = {}

    def watched_search(policy: Any, current: dict[str, Any], *args: Any, **kwargs: Any) -> Search:
        seen["niceness"] = own_niceness()
        seen["thread"] = threading.current_thread().name
        return Search(None, Prediction(current, {}), "nothing screened beats the applied config", 31)

    monkeypatch.setattr(loop, "search", watched_search)
    before_niceness = own_niceness()
    _, decisions = retune_on_a_trigger(tmp_path, IdleEngine())
    assert seen == {"niceness": 19, "thread": "slotune-retune"}
    assert own_niceness() == before_niceness
    assert [d["reason"] for d in decisions] == ["nothing screened beats the applied config"]


def test_a_block_settles_for_the_longer_of_the_measured_and_the_predicted_request() -> None:
    before = WindowStats(0.0, 15.0, 10, 10, 9, 0.05, 0, 320, 0, 0, (1, 1), mean_gap=0.05)  # 32 tokens x 50 ms
    faster = Search(Prediction({"max_num_seqs": 8}, {"tbt_mean": 0.02}), Prediction({}, {}), "", 1)
    slower = Search(Prediction({"max_num_seqs": 8}, {"tbt_mean": 0.25}), Prediction({}, {}), "", 1)
    assert service_time(before, faster) == pytest.approx(1.6)
    assert service_time(before, slower) == pytest.approx(8.0)  # the candidate's larger batch: longer steps
    assert service_time(before, Search(None, Prediction({}, {}), "", 0)) == pytest.approx(1.6)


def test_a_target_between_bucket_bounds_is_named_at_start_up() -> None:
    s = scrape(0, ok=10, count=10, finished=10, ttft_ok=8)
    assert off_bucket_targets(s, SLO(tbt_p99=0.05, ttft_p99=2.0)) == []
    notes = off_bucket_targets(s, SLO(tbt_p99=0.045, ttft_p99=2.5))
    assert len(notes) == 2 and "read at 40ms" in notes[0] and "TTFT target 2.50s" in notes[1]
