"""The whole capacity flow of `tune` (floor, the default config's rate search, the screen, the searches of the best
configs, the paired verdict, tuned.yaml) on the simulator standing in for the engine: deterministic, in seconds."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from loadtest.summary import SLO
from policies import load_policy
from tuner.commands.capacity_run import CapacityRun
from tuner.commands.tune import build_parser
from tuner.commands.session import TuneSession
from tuner.simulation.profiles import limits_of, profile_path
from tuner.simulation.simulator_trial import SimTrialRunner
from tuner.simulation.step_time_model import StepTimeModel
from tuner.search.study import enqueue_default, open_storage, open_study


def run_on_the_simulator(tmp_path: Path, tbt: float, capsys: pytest.CaptureFixture[str],
                         searches_budget: float | None = None) -> tuple[int, str, str]:
    policy = load_policy().replace(trials=3)
    if searches_budget is not None:  # a time budget spent before the searches (less than one verdict round)
        policy = policy.replace(time_budget=searches_budget)
    policy = policy.replace(slo=policy.slo.__class__(tbt_p99=tbt, ttft_p99=2.0))
    args = build_parser().parse_args(["--out", str(tmp_path / "out" / "tuned.yaml"), "--screen", "6"])
    storage = open_storage(f"sqlite:///{tmp_path}/study.db")
    session = TuneSession(args, policy, storage, None)
    model = StepTimeModel.load(profile_path(None))
    sim = SimTrialRunner(model, limits=limits_of(model), workload=policy.workload, duration=policy.trial_duration,
                         warmup=policy.warmup, slo=SLO(tbt, 2.0), seed=policy.seed)
    study = open_study(storage, session.study_name, policy)
    enqueue_default(study)
    rc = CapacityRun(session, sim, study, "sim").run()
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_the_capacity_flow_on_the_simulator_writes_capacities_intervals_and_a_verdict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_on_the_simulator(tmp_path, 0.050, capsys)
    assert rc == 0, out
    assert "floor: batch-1 p99 TBT" in out and "screened" in out
    assert re.search(r"\[1/3\] #0 default config \| capacity [\d.]+ req/s \(bracket ", out), out
    assert re.search(r"round 1: default .*; candidate 1 .* (better|not better|undecided)", out), out
    # the default's search stops at a factor of 2: the verdict measures it again beside every candidate
    low, high = map(float, re.search(r"#0 default config \| capacity [\d.]+ req/s \(bracket ([\d.]+)-([\d.]+)\)",
                                     out).groups())  # type: ignore[union-attr]
    assert low == 0 or high / low <= 2.0 + 1e-6, out
    last = out.strip().splitlines()[-1]
    assert last.startswith(("tuned serves ", "no config beats the default beyond the noise")), last
    assert "p99 TBT <= 50ms and p99 TTFT <= 2.00s" in last
    doc = yaml.safe_load((tmp_path / "out" / "tuned.yaml").read_text())
    assert doc["objective"] == "capacity" and doc["evidence"]["verdict_line"] == last
    for side in ("tuned", "default"):
        cap = doc[side]["capacity_req_per_s"]
        assert {"value", "low", "high", "level", "n"} <= set(cap) and doc[side]["rounds"] >= 1
        # fresh draws pooled per rate: counts a reader can check against the interval
        assert all(p["requests"] >= p["attaining"] >= 0 for p in doc[side]["pools"])
    if last.startswith("tuned serves"):
        ratio = doc["tuned"]["ratio_to_default"]
        assert ratio["low"] > 1.0 and not doc["evidence"]["tuned_is_default"] and doc["evidence"]["held"]
    confirmed = doc["evidence"]["confirmed"]
    assert confirmed and all(row["predicted"] is not None for row in confirmed)
    # the engine here is the simulator itself: the twin of each search sees the same draws at the same rates and
    # decides alike, so it walks the same probes to the same bracket
    for row in confirmed:
        assert row["twin_probes"] == row["engine_probes"] and row["twin_bracket"] == row["bracket"], row
        assert row["agrees"] and row["twin_over_measured"] == 1.0
        # and every window it measured, run again on the same arrivals, reads the same attainment
        assert row["windows"] and all(w["attainment"][0] == w["attainment"][1] for w in row["windows"]), row
        agreement = row["window_agreement"]
        assert agreement["median_abs_attainment_diff"] == 0 and agreement["same_side_of_90"] == agreement["windows"]
        assert row["same_windows_bracket"] == row["bracket"] and row["same_windows_agree"]
    # the verdict's candidate carries the bracket its sustained measurements showed, the same as tuned.yaml's
    searched = [row for row in confirmed if row["sustained_bracket"] is not None]
    assert len(searched) == 1
    if last.startswith("tuned serves"):
        cap = doc["tuned"]["capacity_req_per_s"]
        assert searched[0]["sustained_bracket"] == [cap["low"], cap["high"]]
    assert "&id" not in (tmp_path / "out" / "tuned.yaml").read_text()
    assert (tmp_path / "out" / "tuned.html").exists()


def test_one_candidate_is_searched_even_when_the_default_s_search_spent_the_searches_budget(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A study of the default config alone cannot answer the question: the first screened candidate is searched
    whatever the clock says; the budget stops the searches after it."""
    rc, out, _ = run_on_the_simulator(tmp_path, 0.050, capsys, searches_budget=0.001)
    assert rc == 0, out
    assert re.search(r"\[2/3\] #1 seqs=", out) and "[3/3]" not in out, out
    assert "no further configs searched" in out and "candidate 1" in out


def test_the_verdict_splits_its_error_rate_over_the_rounds_its_budget_holds(tmp_path: Path) -> None:
    """Looks fixed before the first round, from the budget left: a budget that holds two full rounds gets two looks
    at 97.5 % each (not four at 98.75 %), one that holds less than a round one look at the overall 95 %."""
    policy = load_policy()
    args = build_parser().parse_args(["--out", str(tmp_path / "tuned.yaml")])
    storage = open_storage(f"sqlite:///{tmp_path}/study.db")
    model = StepTimeModel.load(profile_path(None))
    sim = SimTrialRunner(model, limits=limits_of(model), workload=policy.workload, duration=policy.trial_duration,
                         warmup=policy.warmup, slo=SLO(0.05, 2.0))
    session = TuneSession(args, policy, storage, None)
    run = CapacityRun(session, sim, open_study(storage, session.study_name, policy), "sim")
    full = run.full_round_s()
    # each measurement one sustained 60 s window and its warm-up
    assert full == (1 + policy.verdict.candidates) * (policy.verdict.window + policy.warmup)
    assert run.verdict_spec(2).sustained_s == policy.verdict.window == 60.0
    windows = CapacityRun(TuneSession(args, policy.replace(verdict=replace(policy.verdict, window=0.0)), storage, None),
                          sim, open_study(storage, session.study_name, policy), "sim")
    assert windows.full_round_s() == (1 + policy.verdict.candidates) * 3 * (policy.trial_duration + policy.warmup)
    for budget, looks in [(0.5 * full, 1), (2.5 * full, 2), (100 * full, policy.verdict.max_rounds)]:
        assert run.planned_looks(budget) == looks
        assert run.verdict_spec(looks).level == pytest.approx(1 - (1 - policy.measurement.level) / looks)


def test_an_slo_below_the_simulated_floor_stops_before_searching(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_on_the_simulator(tmp_path, 0.001, capsys)
    assert rc == 1 and "below this machine's floor" in err
    assert not (tmp_path / "out" / "tuned.yaml").exists()


def test_when_nothing_was_shown_served_the_last_lines_tell_undecided_from_missed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import optuna

    from tuner.search.samplers import ROLE_DEFAULT

    policy = load_policy()
    args = build_parser().parse_args(["--out", str(tmp_path / "tuned.yaml")])
    storage = open_storage(f"sqlite:///{tmp_path}/study.db")
    session = TuneSession(args, policy, storage, None)
    study = open_study(storage, session.study_name, policy)
    model = StepTimeModel.load(profile_path(None))
    sim = SimTrialRunner(model, limits=limits_of(model), workload=policy.workload, duration=policy.trial_duration,
                         warmup=policy.warmup, slo=SLO(0.05, 2.0))
    run = CapacityRun(session, sim, study, "sim")

    def add(role: str, probes: list[tuple[float, str]], stopped: str) -> None:
        cap = {"bracket": [0.0, min(r for r, _ in probes)], "stopped": stopped,
               "probes": [{"rate": r, "verdict": v, "describe": ""} for r, v in probes]}
        study.add_trial(optuna.trial.create_trial(value=0.0, user_attrs={
            "role": role, "knobs": {"max_num_seqs": 64}, "capacity": cap, "feasible": False}))

    add(ROLE_DEFAULT, [(1.0, "missed"), (0.5, "undecided")], "undecided at 0.5 req/s (attainment 93%)")
    assert run.finish() == 1
    err = capsys.readouterr().err
    assert "no config was shown to serve any rate" in err
    assert "#0 default config: missed at 1 req/s, undecided at 0.5 req/s" in err
    assert "undecided is not missed" in err and "longer measurement cap" in err
    assert not (tmp_path / "tuned.yaml").exists() and (tmp_path / "tuned.html").exists()

    study2 = open_study(storage, "all-missed", policy)
    run.study = study2
    study = study2
    add(ROLE_DEFAULT, [(1.0, "missed"), (0.5, "missed")], "not served at 0.5 req/s")
    assert run.finish() == 1
    assert "every rate probed was missed: try a looser target" in capsys.readouterr().err


# the real traces: $SLOTUNE_TRACES, else a shared/traces folder beside the clone
TRACES = Path(os.environ.get("SLOTUNE_TRACES") or Path(__file__).resolve().parents[2] / "shared" / "traces")
CONV = TRACES / "azure2023" / "AzureLLMInferenceTrace_conv.csv"


@pytest.mark.skipif(not CONV.exists(), reason=f"real traces not found at {CONV}")
def test_on_a_trace_every_arrival_draw_replays_its_own_segment_the_same_for_every_config(tmp_path: Path) -> None:
    """The floor and every measurement pool windows of fresh draws: on a trace each draw is another stretch of it
    (the trace's start alone holds one request in the floor's first window at 1 req/s), and within a draw every
    config replays the same stretch (common random numbers)."""
    from policies import WorkloadSpec
    from tuner.measure.floor import measure_floor
    from tuner.measure.measurement import MeasurementSpec

    workload = WorkloadSpec(name=str(CONV), length_scale=0.125, max_context=2048)
    model = StepTimeModel.load(profile_path(None))
    sim = SimTrialRunner(model, limits=limits_of(model), workload=workload, duration=15.0, warmup=3.0,
                         slo=SLO(0.05, 2.0), seed=0)
    floor, outcomes = measure_floor(sim, tmp_path / "floor", spec=MeasurementSpec(min_gaps=400, max_segments=3))
    assert floor.reason is None and floor.tbt_p99_batch1.value is not None, floor.describe()
    offsets = [o.summary["trace_offset_s"] for o in outcomes]
    assert len(set(offsets)) > 1 and all(o.summary["requests"] > 0 for o in outcomes)
    a = sim.run({"max_num_seqs": 1}, tmp_path / "a", rate=1.0, seed=5)
    b = sim.run({"max_num_seqs": 8}, tmp_path / "b", rate=1.0, seed=5)
    c = sim.run({"max_num_seqs": 8}, tmp_path / "c", rate=1.0, seed=6)
    assert a.summary["trace_offset_s"] == b.summary["trace_offset_s"] != c.summary["trace_offset_s"]


def test_capacity_brackets_meet_when_they_overlap_or_touch() -> None:
    from tuner.search.confirmation import brackets_meet

    assert brackets_meet([4.43, 4.9], [4.9, 5.42])  # a step apart: the capacity may be 4.9 in both
    assert brackets_meet([4.0, None], [6.0, 6.64])  # never missed up to 4.0: it may serve 6
    assert not brackets_meet([4.43, 4.9], [5.42, 6.0])
    assert not brackets_meet([0.0, 1.0], [2.0, 2.2])  # served nowhere down to 1 req/s against 2 req/s


def test_window_agreement_on_known_pairs() -> None:
    from tuner.search.confirmation import window_agreement

    pairs = [{"attainment": [0.96, 1.0]}, {"attainment": [0.95, 0.93]}, {"attainment": [0.5, 0.95]},
             {"attainment": [None, 0.9]}]
    a = window_agreement(pairs)
    assert a["windows"] == 3 and a["median_abs_attainment_diff"] == pytest.approx(0.04)
    assert a["largest_attainment_diff"] == pytest.approx(0.45) and a["same_side_of_90"] == 2
    assert window_agreement([]) == {"windows": 0}


def test_the_bracket_of_a_searchs_verdicts() -> None:
    from tuner.search.confirmation import bracket_of

    assert bracket_of([(8.0, "missed"), (5.33, "undecided"), (3.56, "met"), (4.82, "met")], 0.15) == [4.82, 5.33]
    assert bracket_of([(2.0, "met"), (4.0, "met")], 0.15) == [4.0, None]
    assert bracket_of([(1.0, "missed"), (0.5, "undecided")], 0.15) == [0.0, 0.5]
    # a lower rate missed after a higher one was met: noise, kept one resolution step above the rate met
    assert bracket_of([(4.0, "met"), (3.0, "missed")], 0.15) == [4.0, 4.6]
