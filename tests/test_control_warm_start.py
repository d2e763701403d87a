"""The controller's warm start from the shared Optuna storage, on real SQLite storages: the best feasible config of
each study (as the tuner's trial loop writes it) is read, the most recent study first; infeasible, failed and
unfinished trials are not; those configs are the first candidates a retune screens, brought within the guardrails;
an empty storage, an empty study, a storage file that does not exist and one that is not a database are handled
without an exception."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
import yaml
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from slotune.slo import SLO
from policies import parse_policy
from tests.test_tuner_study import CheapRunner, goodput_policy
from tuner.control.candidates import judging_drain, search
from tuner.control.decision_log import DecisionLog
from tuner.control.loop import Controller
from tuner.control.shape import Shape
from tuner.control.warm_start import best_knobs
from tuner.search.objective import CONSTRAINTS_ATTR
from tuner.search.screening import load_profile
from tuner.search.study import best_trial, enqueue_default, open_storage, open_study, run_trials

DEFAULT = yaml.safe_load(Path("policies/default.yaml").read_text())
CURRENT = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "chunk_size": 32, "block_size": 16}


def add(study: optuna.Study, knobs: dict[str, Any], value: float, *, feasible: bool = True,
        state: TrialState = TrialState.COMPLETE) -> None:
    """A finished trial as the tuner's trial loop stores it (knobs, feasibility and constraint values in its user
    attributes)."""
    attrs = {"knobs": knobs, "feasible": feasible, CONSTRAINTS_ATTR: [-0.01 if feasible else 0.02],
             "summary": {"tbt_p99": 0.04}}
    study.add_trial(create_trial(state=state, value=value if state == TrialState.COMPLETE else None,
                                 params={"max_num_seqs": knobs["max_num_seqs"]},
                                 distributions={"max_num_seqs": IntDistribution(1, 64)}, user_attrs=attrs))


def test_the_best_feasible_config_of_each_study_is_read_most_recent_first(tmp_path: Path) -> None:
    db = tmp_path / "studies.db"
    storage = open_storage(str(db))
    # a study the tuner's own trial loop ran (its default config breaks the SLO there, others meet it)
    policy = goodput_policy().replace(trials=6)
    tuned = open_study(storage, "tuned", policy)
    enqueue_default(tuned)
    run_trials(tuned, CheapRunner(), policy, 6, tmp_path / "trials")
    expected = best_trial(tuned)
    assert expected is not None and expected.user_attrs["feasible"]
    # a later study by hand: its highest value is infeasible, one trial failed, one never finished
    later = optuna.create_study(storage=storage, study_name="later", direction="maximize")
    add(later, {**CURRENT, "max_num_seqs": 12}, 9.0, feasible=False)
    add(later, {**CURRENT, "max_num_seqs": 8}, 5.0)
    add(later, {**CURRENT, "max_num_seqs": 2}, 3.0)
    add(later, {**CURRENT, "max_num_seqs": 16}, 0.0, state=TrialState.FAIL)
    add(later, {**CURRENT, "max_num_seqs": 6}, 0.0, state=TrialState.RUNNING)
    # and one where nothing met the SLO, and one without trials: they offer nothing
    hopeless = optuna.create_study(storage=storage, study_name="hopeless", direction="maximize")
    add(hopeless, {**CURRENT, "max_num_seqs": 1}, 1.0, feasible=False)
    optuna.create_study(storage=storage, study_name="empty", direction="maximize")

    knobs, problem = best_knobs(str(db))
    assert problem is None
    assert knobs == [{**CURRENT, "max_num_seqs": 8}, expected.user_attrs["knobs"]]
    # the same through the controller, and any storage URL the tuner accepts
    controller = Controller(parse_policy(DEFAULT), None, None, DecisionLog(tmp_path / "c.jsonl"),
                            storage=f"sqlite:///{db}", say=pytest.fail)
    assert controller.study_knobs() == knobs


def test_a_retune_screens_the_studys_best_configs_first_within_the_guardrails(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import tuner.control.candidates as candidates

    screened: list[dict[str, Any]] = []
    real = candidates.SimTrialRunner

    class Recording(real):
        def run(self, knobs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            screened.append(dict(knobs))
            return super().run(knobs, *args, **kwargs)

    monkeypatch.setattr(candidates, "SimTrialRunner", Recording)
    db = tmp_path / "studies.db"
    study = optuna.create_study(storage=open_storage(str(db)), study_name="s", direction="maximize")
    add(study, {"max_num_seqs": 16, "max_num_batched_tokens": 256, "chunk_size": 128, "block_size": 32}, 7.0)
    older = optuna.create_study(storage=open_storage(str(db)), study_name="t", direction="maximize")
    add(older, dict(CURRENT), 4.0)  # the applied config itself: not a move
    study_knobs, problem = best_knobs(str(db))
    assert problem is None and len(study_knobs) == 2

    policy = parse_policy({**DEFAULT, "guardrails": {"max_change": {"max_num_seqs": 2}, "default_max_change": 2,
                                                     "frozen": ["block_size"]},
                           "retune": {"candidates": 3, "sim_duration": "5s"}})
    rng = np.random.default_rng(0)
    shape = Shape(30.0, 60, tuple(rng.normal(40, 5, 15)), tuple(rng.normal(30, 4, 15)), math.nan)
    found = search(policy, dict(CURRENT), dict(CURRENT), shape, [], study_knobs, target=0.9, seed=1)
    assert screened[0] == {}  # the applied config's own prediction
    # the study's best, brought within one move: max_num_seqs at most 2x, the others at most 2x, block_size frozen
    assert screened[1] == {"max_num_seqs": 8, "max_num_batched_tokens": 128, "chunk_size": 64, "block_size": 16}
    assert found.screened == 1 + 3 and CURRENT not in screened[1:found.screened + 1]
    # then the pick and the applied config on fresh draws, when the screen found a pick
    redrawn = screened[found.screened + 1:]
    assert len(redrawn) == (2 * policy.control.retune.draws if found.redraws else 0)


def test_an_empty_or_missing_storage_gives_no_warm_start_and_says_why(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    open_storage(str(empty))  # a storage with no study
    assert best_knobs(str(empty)) == ([], None)
    # a file that does not exist is reported and not created (a mistyped path is not an empty storage)
    for spec in (str(tmp_path / "nowhere.db"), f"sqlite:///{tmp_path}/nowhere.db", f"journal:{tmp_path}/nowhere.log"):
        knobs, problem = best_knobs(spec)
        assert knobs == [] and problem is not None and "does not exist" in problem, spec
    assert not any(p.name.startswith("nowhere") for p in tmp_path.iterdir())
    broken = tmp_path / "broken.db"
    broken.write_text("not a database")
    knobs, problem = best_knobs(str(broken))
    assert knobs == [] and problem
    # the controller goes on without a warm start, and says why
    said: list[str] = []
    controller = Controller(parse_policy(DEFAULT), None, None, DecisionLog(tmp_path / "c.jsonl"),
                            storage=str(tmp_path / "nowhere.db"), say=said.append)
    assert controller.study_knobs() == [] and "does not exist" in said[0]
    assert Controller(parse_policy(DEFAULT), None, None, DecisionLog(tmp_path / "d.jsonl")).study_knobs() == []


def test_behind_a_deep_queue_the_retune_moves_to_the_config_that_drains_it() -> None:
    # the phase-one config (two sequences) behind 48 long requests: no config attains within a short simulated
    # window, so attainment and goodput cannot tell configs apart; the one that finishes more requests drains the
    # queue sooner, and the retune moves there
    policy = parse_policy({**DEFAULT, "guardrails": {"default_max_change": 4},
                           "retune": {"candidates": 8, "sim_duration": "20s", "headroom": 1.25}})
    current = {"max_num_seqs": 2, "max_num_batched_tokens": 64, "chunk_size": 32, "block_size": 16}
    shape = Shape(60.0, 54, tuple([16.0] * 30), tuple([160.0] * 30), math.nan)
    found = search(policy, dict(current), dict(current), shape, [], [], target=0.9, seed=1, backlog=48)
    assert found.candidate is not None, found.reason
    assert found.candidate.throughput > found.current.throughput
    assert found.candidate.knobs["max_num_seqs"] > 2 and "behind a queue of 48" in found.reason


def test_on_a_slow_machine_behind_a_queue_the_retune_still_moves_to_the_config_that_drains_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the engine's steps measured at 2.4x the shipped profile (a slow CPU shared with the load generator): behind
    # 25 long requests, the window's own arrivals do not even start within the simulated window, and a long
    # request takes longer than a short drain; the retune must still see which config serves more
    import tuner.control.candidates as candidates

    base = load_profile(None, "bfloat16")
    slow = dataclasses.replace(base, coef={k: v * 2.4 for k, v in base.coef.items()})
    monkeypatch.setattr(candidates, "refitted_model", lambda *args, **kwargs: slow)
    policy = parse_policy({**DEFAULT, "slo": {"tbt_p99": "250ms", "ttft_p99": "3s"},
                           "guardrails": {"default_max_change": 4},
                           "retune": {"candidates": 16, "sim_duration": "20s", "headroom": 1.25}})
    current = {"max_num_seqs": 2, "max_num_batched_tokens": 64, "chunk_size": 32, "block_size": 16}
    shape = Shape(28.0, 29, tuple([16.0] * 20), tuple([160.0] * 20), math.nan)
    found = search(policy, dict(current), dict(current), shape, [], [], target=0.9, seed=1, backlog=25,
                   dtype="bfloat16")
    assert found.candidate is not None, found.reason
    assert found.candidate.knobs["max_num_seqs"] > 2
    assert found.candidate.throughput > found.current.throughput > 0
    # the simulated drain leaves time for the longest live output (240 tokens) to finish within the SLO
    assert found.workload["drain_s"] == pytest.approx(3.0 + 1.5 * 0.25 * 240)


def test_the_simulated_drain_lasts_as_long_as_an_attaining_request_could() -> None:
    assert judging_drain(SLO(tbt_p99=0.1, ttft_p99=2.0), 200) == pytest.approx(2.0 + 1.5 * 0.1 * 200)
    assert judging_drain(SLO(tbt_p99=0.1, ttft_p99=2.0, e2e_p99=25.0), 200) == 25.0  # the e2e target bounds it
    assert judging_drain(SLO(tbt_p99=0.05), 100) == pytest.approx(120.0 + 7.5)  # no TTFT target: the timeout's
    assert judging_drain(SLO(tbt_p99=0.01, ttft_p99=1.0), 10) == 10.0  # never shorter than the load test's
    assert judging_drain(SLO(tbt_p99=1.0), 10_000) == 300.0  # nor unbounded
