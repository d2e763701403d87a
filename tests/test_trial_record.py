"""The per-trial record of `tune`'s study (tuner/search/trial_record.py): what the write side stamps reads back equal
from a real Optuna storage, a trial of an older study (only the plain string attrs) reads with the right values and
defaults, and the attr names, the storage format, stay those existing studies hold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.storages.journal import JournalFileBackend

from tuner.search.trial_record import (CONSTRAINTS_ATTR, ROLE_DEFAULT, ROLE_SCREENED, ROLE_SEARCH, START_STEP_ATTR,
                                       SURPLUS_ATTR, StudyRecord, TrialRecord, capacity_prediction, default_attrs,
                                       design_seed_attrs, goodput_prediction, heartbeat_attrs, measured_attrs,
                                       owner_attrs, rate_attrs, screened_attrs, stamp, start_attrs, study_attrs)

KNOBS = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "block_size": 16}
SUMMARY = {"goodput_rps": 2.5, "tbt_p99": 0.041, "ttft_p99": 0.8, "attainment": 0.95}
CAPACITY = {"req_per_s": 2.4, "bracket": [2.4, 2.8], "describe": "searched 2.4 req/s", "at_capacity": None,
            "probes": [{"rate": 2.4, "verdict": "met"}, {"rate": 2.8, "verdict": "missed"}]}


def _storage(kind: str, tmp_path: Path) -> optuna.storages.BaseStorage:
    if kind == "memory":
        return optuna.storages.InMemoryStorage()
    return optuna.storages.JournalStorage(JournalFileBackend(str(tmp_path / "s.journal")))


@pytest.mark.parametrize("kind", ["memory", "journal"])
def test_a_record_written_through_the_write_side_reads_back_equal(kind: str, tmp_path: Path) -> None:
    storage = _storage(kind, tmp_path)
    study = optuna.create_study(storage=storage, study_name="s", direction="maximize")
    prediction = capacity_prediction(2.6, [2.5, 2.6, 2.9], "ttft_p99")
    study.enqueue_trial({"max_num_seqs": 16}, user_attrs=screened_attrs(2, prediction, scale=0.9))
    trial = study.ask()
    trial.suggest_int("max_num_seqs", 1, 64)
    stamp(trial, owner_attrs(1234, "host-a"))
    stamp(trial, heartbeat_attrs(1_780_000_000.5))
    stamp(trial, measured_attrs(knobs=KNOBS, summary=SUMMARY, step_stats={"steps": 10.0}, feasible=True, reason=None,
                                trial_dir="out/trial-0000/w", steps_dir="out/trial-0000", simulated=False,
                                pruned=False, rate=2.4, constraints=[-0.009, -1.2],
                                capacity_probes=[{"rate": 2.4}], capacity=CAPACITY))
    study.tell(trial, 2.4)
    stamp(study, study_attrs(slo={"tbt_p99": 0.05}, workload={"name": "mixed"}, objective="capacity", model="m",
                             policy={"trials": 4}))
    stamp(study, design_seed_attrs(7))

    reloaded = optuna.load_study(study_name="s", storage=storage)
    record = TrialRecord.from_trial(reloaded.trials[0])
    assert record == TrialRecord(
        role=ROLE_SCREENED, screen_rank=2, screen_scale=0.9, screen_predicted_capacity=2.6,
        screen_capacities=[2.5, 2.6, 2.9], screen_bound="ttft_p99", pid=1234, host="host-a",
        heartbeat=1_780_000_000.5, knobs=KNOBS, summary=SUMMARY, step_stats={"steps": 10.0}, feasible=True,
        reason=None, trial_dir="out/trial-0000/w", steps_dir="out/trial-0000", simulated=False, pruned=False,
        rate=2.4, constraints=[-0.009, -1.2], capacity_probes=[{"rate": 2.4}], capacity=CAPACITY)
    assert record.measured and record.role_or_search == ROLE_SCREENED
    assert StudyRecord.from_study(reloaded) == StudyRecord(slo={"tbt_p99": 0.05}, workload={"name": "mixed"},
                                                           objective="capacity", model="m", policy={"trials": 4},
                                                           design_seed=7)


def test_the_attr_names_are_those_existing_studies_hold() -> None:
    """The storage format: the same names (and JSON values) as the tuner wrote before the record existed."""
    assert default_attrs() == {"role": "default"}
    assert start_attrs("line") == {"role": "start", "start_step": "line"}
    assert screened_attrs(1, goodput_prediction({"goodput_rps": 2.0})) == {
        "role": "screened", "screen_rank": 1, "screen_predicted": {"goodput_rps": 2.0}}
    assert screened_attrs(3, capacity_prediction(2.0, [2.0], None), scale=1.1) == {
        "role": "screened", "screen_rank": 3, "screen_scale": 1.1, "screen_predicted_capacity": 2.0,
        "screen_capacities": [2.0], "screen_bound": None}
    assert owner_attrs(1, "h") == {"pid": 1, "host": "h"} and heartbeat_attrs(2.0) == {"heartbeat": 2.0}
    measured = measured_attrs(knobs={}, summary={}, step_stats={}, feasible=False, reason="r", trial_dir="",
                              steps_dir="d", simulated=True, pruned=True, rate=None, constraints=[1.0])
    assert list(measured) == ["knobs", "summary", "step_stats", "feasible", "reason", "trial_dir", "simulated",
                              "steps_dir", "pruned", "rate", "constraints"]  # no capacity attrs without them
    assert (CONSTRAINTS_ATTR, SURPLUS_ATTR, START_STEP_ATTR) == ("constraints", "surplus", "start_step")
    assert rate_attrs(2.0, "given") == {"rate": 2.0, "rate_reason": "given"}
    with pytest.raises(KeyError, match="screen_predictd"):  # a typo would write a new attr
        screened_attrs(1, {"screen_predictd": {}})


def _old_trial(attrs: dict[str, Any], state: optuna.trial.TrialState = optuna.trial.TrialState.COMPLETE
               ) -> optuna.trial.FrozenTrial:
    return optuna.trial.create_trial(
        state=state, value=1.5 if state == optuna.trial.TrialState.COMPLETE else None,
        params={"max_num_seqs": 8}, distributions={"max_num_seqs": IntDistribution(1, 64)}, user_attrs=attrs)


def test_a_trial_of_an_older_study_reads_its_string_attrs_and_defaults_the_rest() -> None:
    study = optuna.create_study(direction="maximize")
    study.add_trial(_old_trial({"role": "default", "knobs": KNOBS, "summary": SUMMARY, "step_stats": {},
                                "feasible": True, "reason": None, "trial_dir": "results/t0", "simulated": False,
                                "constraints": [-0.01], "a_retired_attr": {"x": 1}}))
    study.add_trial(_old_trial({}, optuna.trial.TrialState.FAIL))
    old, bare = (TrialRecord.from_trial(t) for t in study.trials)
    assert old == TrialRecord(role=ROLE_DEFAULT, knobs=KNOBS, summary=SUMMARY, step_stats={}, feasible=True,
                              trial_dir="results/t0", constraints=[-0.01])
    assert old.steps_dir is None and old.capacity is None and old.rate is None and not old.pruned
    assert bare == TrialRecord() and not bare.measured and bare.role_or_search == ROLE_SEARCH
    assert bare.feasible is None and bare.surplus is False and bare.constraints is None


def test_a_value_of_the_wrong_json_type_reads_as_the_default() -> None:
    record = TrialRecord.from_attrs({"pid": "12", "heartbeat": True, "knobs": [1], "rate": 2, "feasible": 1,
                                     "simulated": 0, "screen_rank": 1.0, "surplus": "yes"})
    assert record.pid is None and record.heartbeat is None and record.knobs is None and record.screen_rank is None
    assert record.rate == 2 and record.feasible is True and record.simulated is False and record.surplus is True
    assert StudyRecord.from_attrs({"workload": "mixed", "rate": "fast"}) == StudyRecord(workload="mixed")
