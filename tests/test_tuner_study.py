"""The study's plumbing on a cheap objective (no engine): storages, every sampler, constraints, the default trial,
resume and sharing, capacity bisection; plus pruning and step statistics on hand-made data."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import optuna
import pytest
from optuna.trial import TrialState

import tuner.search.study
from dashboards.study import load_study
from slotune.slo import SLO
from policies import SAMPLERS, Policy, PruningSpec, load_policy
from tests.test_measurement import ScriptedBackend
from tuner.measure.capacity import CapacitySearcher
from tuner.measure.measurement import MeasurementSpec
from tuner.search.objective import constraints_func, evaluate_capacity
from tuner.trials.engine_metrics import SLOTUNE_SERIES, histogram_buckets
from tuner.trials.pruning import PruneWatcher, gaps_above
from tuner.search.structured_start import ROLE_START, START_STEP_ATTR, startup_trials
from tuner.search.auto_rate import choose_rate
from tuner.search.study import (HEARTBEAT_STALE_S, ROLE_DEFAULT, SURPLUS_ATTR, Heartbeat, StorageError, best_trial,
                         closest_trial, counted_trials, default_trial, enqueue_default, is_surplus,
                         open_storage, open_study, recover_orphans, run_trials)
from tuner.trials.trial_runner import TrialOutcome, feasibility, step_stats

DEFAULT_KNOBS = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "chunk_size": None, "block_size": 16}


def goodput_policy() -> Policy:
    """The default policy at a fixed offered load (the study's mechanics; capacity has its own tests)."""
    return load_policy().replace(objective="goodput")


@dataclass
class CheapRunner:
    """Stands in for the engine measurement only: p99 TBT grows with the batch and the prefill chunk, goodput with
    the batch (up to the offered rate); the SLO is 50 ms."""

    rate: float = 4.0
    slo: SLO = field(default_factory=lambda: SLO(tbt_p99=0.050))
    base_knobs: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_KNOBS))
    calls: list[dict[str, Any]] = field(default_factory=list)

    def run(self, knobs: dict[str, Any], out_dir: Path, rate: float | None = None,
            prune: bool = True) -> TrialOutcome:
        k = {**self.base_knobs, **knobs}
        rate = self.rate if rate is None else rate
        self.calls.append(k)
        chunk = k["chunk_size"] or k["max_num_batched_tokens"]
        tbt = 0.030 + 0.002 * k["max_num_seqs"] + 0.0001 * chunk
        served = min(rate, 0.5 * k["max_num_seqs"])
        attainment = served / rate if tbt <= self.slo.tbt_p99 else 0.1
        summary = {"requests": 10, "completed": 10, "tbt_p99": tbt, "ttft_p99": 1.0, "e2e_p99": 2.0,
                   "attainment": attainment, "goodput_rps": rate * attainment}
        reason = feasibility(summary, self.slo)
        return TrialOutcome(k, summary, step_stats([]), reason is None, reason, out_dir, rate=rate)


def test_storage_specs(tmp_path: Path) -> None:
    assert isinstance(open_storage(f"sqlite:///{tmp_path}/a.db"), optuna.storages.RDBStorage)
    assert isinstance(open_storage(str(tmp_path / "b.db")), optuna.storages.RDBStorage)
    assert isinstance(open_storage(f"journal:{tmp_path}/c.log"), optuna.storages.JournalStorage)
    assert isinstance(open_storage(str(tmp_path / "d.journal")), optuna.storages.JournalStorage)
    for bad, words in (("studies", "neither a database URL"), ("nosuchdb://x/y", "cannot open"),
                       ("journal:", "needs a file"), ("postgresql://u:p@127.0.0.1:1/none", "cannot open")):
        with pytest.raises(StorageError, match=words):
            open_storage(bad)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_sampler_runs_trials_with_constraints(tmp_path: Path, sampler: str) -> None:
    policy = goodput_policy().replace(sampler=sampler, trials=6)
    study = open_study(open_storage(str(tmp_path / "s.db")), "s", policy)
    enqueue_default(study)
    runner = CheapRunner()
    reports = []
    assert run_trials(study, runner, policy, 6, tmp_path, on_trial=reports.append) == 6
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 6
    assert trials[0].user_attrs["role"] == ROLE_DEFAULT and trials[0].params == {}
    assert runner.calls[0] == DEFAULT_KNOBS  # the default config measured first, as it is
    for t in trials:
        for key in ("knobs", "summary", "step_stats", "feasible", "reason", "trial_dir", "simulated"):
            assert key in t.user_attrs
        assert t.system_attrs["constraints"] == t.user_attrs["constraints"]  # what Optuna's samplers read
        assert (t.user_attrs["constraints"][0] <= 0) == t.user_attrs["feasible"]
        knobs = t.user_attrs["knobs"]
        if (knobs["chunk_size"] or 0) and t.user_attrs.get("role") != ROLE_DEFAULT:
            assert knobs["chunk_size"] <= knobs["max_num_batched_tokens"]  # the policy's constraints hold
            assert knobs["max_num_seqs"] <= knobs["max_num_batched_tokens"]
    assert not default_trial(study).user_attrs["feasible"]  # 64 sequences break the 50 ms target here
    best = best_trial(study)
    feasible_values = [t.values[0] for t in trials if t.user_attrs["feasible"]]
    if feasible_values:
        assert best is not None and best.values[0] == max(feasible_values)
    else:
        assert best is None and closest_trial(study) is not None
    assert len(study.directions) == (2 if sampler == "nsga2" else 1)
    assert [r.done for r in reports] == [1, 2, 3, 4, 5, 6]


def test_tpe_finds_a_feasible_config_better_than_the_default(tmp_path: Path) -> None:
    policy = goodput_policy().replace(trials=14)
    study = open_study(open_storage(str(tmp_path / "s.db")), "s", policy)
    enqueue_default(study)
    run_trials(study, CheapRunner(), policy, 14, tmp_path)
    best = best_trial(study)
    assert best is not None and best.user_attrs["feasible"]
    assert best.values[0] > default_trial(study).values[0]


def test_a_trial_that_would_end_past_the_deadline_is_not_started(tmp_path: Path) -> None:
    import datetime

    from tuner.search.study import longest_trial_s

    policy = goodput_policy().replace(trials=6)
    study = open_study(open_storage(str(tmp_path / "s.db")), "s", policy)
    enqueue_default(study)
    runner = CheapRunner()
    assert run_trials(study, runner, policy, 6, tmp_path, max_runs=1) == 1
    assert longest_trial_s(study) < 60
    # a trial that took two minutes: with 60 s left before the deadline, the next one is not started
    long = optuna.trial.create_trial(value=1.0, user_attrs={"knobs": {}}, state=TrialState.COMPLETE)
    long.datetime_complete = datetime.datetime.now()
    long.datetime_start = long.datetime_complete - datetime.timedelta(seconds=120)
    study.add_trial(long)
    assert longest_trial_s(study) == pytest.approx(120.0)
    calls = len(runner.calls)
    assert run_trials(study, runner, policy, 8, tmp_path, deadline=time.monotonic() + 60) == 0
    assert len(runner.calls) == calls
    assert run_trials(study, runner, policy, 8, tmp_path, deadline=time.monotonic() + 180, max_runs=1) == 1


@pytest.mark.parametrize("sampler", ["tpe", "gp"])
def test_the_default_trial_leaves_the_samplers_joint_search_space_whole(tmp_path: Path, sampler: str) -> None:
    """The default-config trial has no params; seen by TPE (multivariate) or GP it empties the intersection search
    space and they sample every knob independently (GP: at random) for the rest of the study."""
    policy = goodput_policy().replace(trials=9, sampler=sampler, start="random")
    study = open_study(open_storage(f"journal:{tmp_path}/s.journal"), "s", policy)
    enqueue_default(study)
    run_trials(study, CheapRunner(), policy, 5, tmp_path)
    assert default_trial(study) is not None and not default_trial(study).params
    trial = study.ask()
    space = study.sampler.infer_relative_search_space(study, study._storage.get_trial(trial._trial_id))
    assert set(space) == set(policy.searched)
    joint = {"multivariate": True} if sampler == "tpe" else {}
    unwrapped = type(study.sampler.base)(seed=0, constraints_func=constraints_func, **joint)
    assert unwrapped.infer_relative_search_space(study, study._storage.get_trial(trial._trial_id)) == {}


def _start_knobs(study: optuna.Study) -> list[dict[str, Any]]:
    return [t.user_attrs["knobs"] for t in study.get_trials() if t.user_attrs.get("role") == ROLE_START]


def test_tpe_starts_with_a_max_num_seqs_bisection_then_steps_at_the_boundary(tmp_path: Path) -> None:
    policy = goodput_policy().replace(trials=30)  # 10 start-up trials
    study = open_study(open_storage(str(tmp_path / "s.db")), "s", policy)
    enqueue_default(study)
    run_trials(study, CheapRunner(), policy, 13, tmp_path)
    trials = study.get_trials()
    roles = [t.user_attrs.get("role") for t in trials]
    n = startup_trials(policy)
    assert roles == [ROLE_DEFAULT] + [ROLE_START] * n + [None] * 2  # the start runs first, then TPE
    starts = _start_knobs(study)
    line = [t.user_attrs["knobs"] for t in trials if t.user_attrs.get(START_STEP_ATTR) == "line"]
    # middle of 1-16 (log) first; the CheapRunner meets 50 ms up to 8 sequences at the middle chunk (32)
    assert [k["max_num_seqs"] for k in line] == [4, 9, 6, 7, 8]
    assert all(k["max_num_batched_tokens"] == 64 and k["chunk_size"] == 32 and k["block_size"] == 16 for k in line)
    steps = starts[len(line):]
    assert all(k["max_num_seqs"] in (8, 9) for k in steps)  # around the boundary: best feasible, first infeasible
    assert len({str(sorted(k.items())) for k in starts}) == n  # distinct
    space = {k.name: k for k in policy.search_space}
    for k in starts:  # within the policy's space, its constraints met
        assert k["chunk_size"] <= k["max_num_batched_tokens"] and k["max_num_seqs"] <= k["max_num_batched_tokens"]
        assert space["max_num_seqs"].low <= k["max_num_seqs"] <= space["max_num_seqs"].high
        assert all(k[name] in space[name].choices for name in ("max_num_batched_tokens", "chunk_size", "block_size"))
    # reproducible: the same start (it follows from the results only); resuming continues it without repeats
    again = open_study(open_storage(str(tmp_path / "again.db")), "s", policy)
    enqueue_default(again)
    run_trials(again, CheapRunner(), policy, 4, tmp_path)
    again = open_study(open_storage(str(tmp_path / "again.db")), "s", policy)  # the rerun
    assert not enqueue_default(again)
    run_trials(again, CheapRunner(), policy, 13, tmp_path)
    assert _start_knobs(again) == starts
    # the policy can turn it off: Optuna's random start-up
    off = open_study(open_storage(str(tmp_path / "off.db")), "s", policy.replace(start="random"))
    run_trials(off, CheapRunner(), policy.replace(start="random"), 4, tmp_path)
    assert not _start_knobs(off)


def test_resume_runs_only_the_missing_trials_and_recovers_a_dead_process(tmp_path: Path) -> None:
    policy = goodput_policy().replace(trials=4)
    storage = open_storage(str(tmp_path / "s.db"))
    study = open_study(storage, "s", policy)
    enqueue_default(study)
    run_trials(study, CheapRunner(), policy, 2, tmp_path)
    # a trial left RUNNING by a tune process that was killed (its pid no longer exists)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = study.ask()
    orphan.set_user_attr("pid", dead.pid)
    import socket
    orphan.set_user_attr("host", socket.gethostname())
    study = open_study(storage, "s", policy)  # the rerun
    assert not enqueue_default(study)  # the default was measured already
    runner = CheapRunner()
    assert run_trials(study, runner, policy, 4, tmp_path) == 2
    states = [t.state for t in study.get_trials()]
    assert states.count(TrialState.COMPLETE) == 4 and states[orphan.number] == TrialState.FAIL
    assert recover_orphans(study) == []


def test_a_trial_whose_process_died_on_another_machine_is_recovered_by_its_stale_heartbeat(tmp_path: Path) -> None:
    policy = goodput_policy().replace(trials=4)
    study = open_study(open_storage(str(tmp_path / "s.db")), "s", policy)
    now = time.time()
    stale, live, silent = study.ask(), study.ask(), study.ask()
    for trial, beat in ((stale, now - HEARTBEAT_STALE_S - 5), (live, now - 5)):
        trial.set_user_attr("host", "another-machine")
        trial.set_user_attr("pid", 1)  # a pid there says nothing here
        trial.set_user_attr("heartbeat", beat)
    silent.set_user_attr("host", "another-machine")  # never beat: judged by its start time, which is recent
    assert recover_orphans(study, now=now) == [stale.number]
    assert recover_orphans(study, now=now + HEARTBEAT_STALE_S + 10) == [live.number, silent.number]


def test_a_trial_whose_process_died_before_naming_itself_its_owner_is_recovered(tmp_path: Path) -> None:
    """A tune killed between asking for a trial and stamping its pid left it RUNNING with no owner: the rerun found
    nothing dead and ran one trial short. A live process names itself within milliseconds of its ask."""
    from tuner.search.study import OWNERLESS_GRACE_S

    policy = goodput_policy().replace(trials=4)
    study = open_study(open_storage(str(tmp_path / "s.db")), "s", policy)
    ownerless = study.ask()
    assert ownerless.datetime_start is not None
    started = ownerless.datetime_start.timestamp()
    assert recover_orphans(study, now=started + 1.0) == []  # its process may be stamping it right now
    assert recover_orphans(study, now=started + OWNERLESS_GRACE_S + 1.0) == [ownerless.number]


def test_a_running_trial_keeps_its_heartbeat_fresh(tmp_path: Path) -> None:
    study = open_study(open_storage(f"journal:{tmp_path}/s.journal"), "s", goodput_policy())
    trial = study.ask()
    with Heartbeat(trial, interval=0.05):
        time.sleep(0.3)
        first = study.get_trials()[0].user_attrs["heartbeat"]
        time.sleep(0.2)
        second = study.get_trials()[0].user_attrs["heartbeat"]
    assert time.time() - 1 < first < second <= time.time()


def test_two_processes_share_a_study_without_duplicates(tmp_path: Path) -> None:
    policy = goodput_policy().replace(trials=10)
    path = f"journal:{tmp_path}/shared.journal"
    first = open_study(open_storage(path), "shared", policy)
    enqueue_default(first)
    ran: list[int] = []

    def worker() -> None:
        study = open_study(open_storage(path), "shared", policy)  # each with its own storage object
        ran.append(run_trials(study, CheapRunner(), policy, 10, tmp_path))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trials = first.get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert sum(ran) == 10 and counted_trials(first) == 10 and len(complete) == 10
    # a worker that lost the race for the last slot gave its trial back at once (at most one per worker)
    assert all(t.user_attrs.get(SURPLUS_ATTR) for t in trials if t.state != TrialState.COMPLETE)
    assert len(trials) <= 12
    assert sum(t.user_attrs.get("role") == ROLE_DEFAULT for t in complete) == 1


def test_a_trial_asked_past_the_budget_by_a_racing_process_is_given_back(tmp_path: Path) -> None:
    policy = goodput_policy().replace(trials=3)
    storage = f"journal:{tmp_path}/race.journal"
    study = open_study(open_storage(storage), "race", policy)
    assert run_trials(study, CheapRunner(), policy, 2, tmp_path) == 2
    other = open_study(open_storage(storage), "race", policy)
    racer = other.ask()  # another process counted 2 < 3 and took the last slot
    racer.set_user_attr("pid", os.getpid())
    real_count = tuner.search.study.counted_trials
    # this process counted before the racer's ask landed: it sees room, asks, and must give its trial back
    with mock.patch.object(tuner.search.study, "counted_trials", side_effect=[2, 3]):
        assert run_trials(study, CheapRunner(), policy, 3, tmp_path) == 0
    assert is_surplus(study, racer.number, 3) is False
    given_back = study.get_trials()[-1]
    assert given_back.number > racer.number and given_back.state == TrialState.FAIL
    assert given_back.user_attrs[SURPLUS_ATTR] and real_count(study) == 3
    assert [r.number for r in load_study(storage, "race").rows] == [0, 1, racer.number]  # hidden on the dashboard


@dataclass
class RateScripted(ScriptedBackend):
    """Serves up to ``capacity`` req/s (no stutter), then half the requests stutter."""

    capacity: float = 3.0

    def run(self, knobs: dict[str, Any], out_dir: Path, rate: float | None = None,
            seed: int | None = None) -> TrialOutcome:
        self.bad = 0.0 if (rate or 0.0) <= self.capacity else 0.5
        return super().run(knobs, out_dir, rate, seed)


def test_capacity_objective_searches_the_rate_and_learns_from_neighbours(tmp_path: Path) -> None:
    spec = MeasurementSpec(max_segments=2)
    searcher = CapacitySearcher(RateScripted(0.0), spec, ["max_num_seqs"], resolution=0.15, max_probes=8)
    ev = evaluate_capacity(searcher, {"max_num_seqs": 6}, tmp_path / "a")
    assert ev.capacity is not None and ev.capacity.resolved and ev.value <= 3.0 < ev.capacity.high
    assert [p["rate"] for p in ev.probes][:3] == [1.0, 2.0, 4.0] and ev.outcome.feasible and ev.constraints == [0.0]
    # a neighbour starts where the first config's capacity was, with a smaller step: fewer probes
    near = evaluate_capacity(searcher, {"max_num_seqs": 8}, tmp_path / "b")
    assert near.probes[0]["rate"] == ev.value and len(near.probes) < len(ev.probes)
    none = evaluate_capacity(CapacitySearcher(RateScripted(0.0, capacity=0.0), spec, ["max_num_seqs"],
                                              max_probes=3), {"max_num_seqs": 64}, tmp_path / "c")
    assert none.value == 0.0 and not none.outcome.feasible and none.constraints[0] > 0


def test_the_default_config_is_searched_as_closely_as_every_other(tmp_path: Path) -> None:
    """The default's searched bracket ends within the policy's 15 %, as a candidate's: a ratio to it needs it
    measured as closely."""
    policy = load_policy().replace(objective="capacity", sampler="random", start="random")
    searcher = CapacitySearcher(RateScripted(0.0), MeasurementSpec(max_segments=2), ["max_num_seqs"],
                                resolution=policy.capacity.resolution, max_probes=8)
    study = open_study(open_storage(f"sqlite:///{tmp_path}/s.db"), "default-as-close", policy)
    enqueue_default(study)
    assert run_trials(study, RateScripted(0.0), policy, 2, tmp_path, searcher=searcher) == 2
    for searched in (t.user_attrs["capacity"] for t in study.trials):
        low, high = searched["bracket"]
        assert searched["resolved"] and low <= 3.0 < high and high / low <= 1.15 + 1e-9


@dataclass
class ScriptedRunner(CheapRunner):
    """The default config's attainment per probe, in order (a noisy machine: the same rate may pass, then fail)."""

    script: list[float] = field(default_factory=list)

    def run(self, knobs: dict[str, Any], out_dir: Path, rate: float | None = None,
            prune: bool = True) -> TrialOutcome:
        attainment = self.script[len(self.calls)]
        self.calls.append({"rate": rate})
        summary = {"requests": 10, "completed": 10, "tbt_p99": 0.04 if attainment >= 0.9 else 0.08,
                   "attainment": attainment, "goodput_rps": (rate or 0.0) * attainment}
        return TrialOutcome({}, summary, step_stats([]), attainment >= 0.9, feasibility(summary, self.slo),
                            out_dir, rate=rate)


@pytest.mark.parametrize(("script", "rates", "chosen", "words"), [
    ([1.0, 1.0, 0.8, 0.7], [1, 2, 4, 4], 4, "twice"),  # a confirmed failure
    ([1.0, 0.8, 1.0, 0.5, 0.6], [1, 2, 2, 4, 4], 4, "twice"),  # 2 req/s failed once only: the edge, go on
    ([1.0, 1.0, 0.8, 1.0, 0.85, 0.6], [1, 2, 4, 4, 8, 8], 8, "twice"),
    ([1.0, 1.0, 1.0, 1.0, 1.0, 0.5], [1, 2, 4, 8, 16, 32], 32, "once (no probe left"),
    ([1.0] * 6, [1, 2, 4, 8, 16, 32], 32, "attained >= 90% up to 32"),
])
def test_rate_auto_needs_the_default_to_fail_twice_at_a_rate(tmp_path: Path, script: list[float], rates: list[float],
                                                            chosen: float, words: str) -> None:
    runner = ScriptedRunner(script=script)
    choice = choose_rate(runner, tmp_path, on_probe=lambda rate, outcome: None)
    assert [c["rate"] for c in runner.calls] == rates and [p["rate"] for p in choice.probes] == rates
    assert choice.rate == chosen and words in choice.reason


def itl_buckets(text: str) -> dict[float, float]:
    return histogram_buckets(text, SLOTUNE_SERIES.inter_token_latency)


def test_pruning_judges_the_window_share_above_the_target() -> None:
    text = """# TYPE slotune_inter_token_latency_seconds histogram
slotune_inter_token_latency_seconds_bucket{le="0.04"} %d
slotune_inter_token_latency_seconds_bucket{le="0.05"} %d
slotune_inter_token_latency_seconds_bucket{le="0.06"} %d
slotune_inter_token_latency_seconds_bucket{le="+Inf"} %d
slotune_inter_token_latency_seconds_count %d
slotune_inter_token_latency_seconds_sum 1.0
"""
    before = itl_buckets(text % (100, 100, 100, 100, 100))
    assert before[math.inf] == 100
    after = itl_buckets(text % (150, 180, 190, 300, 300))
    assert gaps_above(before, after, 0.050) == (200, 120)
    assert gaps_above(before, after, 0.045) == (200, 120)  # the next bound up: a sure undercount
    w = PruneWatcher(0.050, PruningSpec(min_gaps=150, violation_share=0.05, min_elapsed=0.3), window_s=20)
    assert w.check(0.0, before) is None  # the baseline
    assert w.check(2.0, after) is None  # too early in the window
    reason = w.check(8.0, after)
    assert reason is not None and "60.0% of 200 gaps" in reason
    calm = PruneWatcher(0.050, PruningSpec(min_gaps=150), window_s=20)
    calm.check(0.0, before)
    assert calm.check(10.0, itl_buckets(text % (300, 399, 399, 400, 400))) is None  # 0.3% above: keep going
    off = PruneWatcher(0.050, PruningSpec(enabled=False), window_s=20)
    off.check(0.0, before)
    assert off.check(10.0, after) is None


def test_step_stats() -> None:
    def rec(prefill: int, decode: int, seqs: int, used: int, total_s: float, pre: int = 0) -> dict[str, Any]:
        return {"num_prefill_tokens": prefill, "num_decode_tokens": decode, "num_prefill_seqs": seqs,
                "kv_blocks_used": used, "kv_blocks_free": 100 - used, "total_s": total_s, "num_preemptions": pre}
    s = step_stats([rec(30, 2, 1, 10, 0.1), rec(0, 4, 0, 20, 0.05, pre=1), rec(10, 4, 2, 30, 0.2)])
    assert s["steps"] == 3
    assert s["mean_batch_seqs"] == pytest.approx((3 + 4 + 6) / 3)
    assert s["mean_prefill_tokens"] == pytest.approx(40 / 3)
    assert s["mean_decode_tokens"] == pytest.approx(10 / 3)
    assert s["prefill_token_share"] == pytest.approx(40 / 50)
    assert s["preemptions"] == 1
    assert s["kv_usage_mean"] == pytest.approx(0.2) and s["kv_usage_max"] == pytest.approx(0.3)
    assert s["step_duration_p50"] == pytest.approx(0.1)
    assert step_stats([])["steps"] == 0
