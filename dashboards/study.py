"""Reading the tuner's Optuna studies (read-only: the dashboard never creates a storage or a study).

Trials carry the user attrs the tuner writes (tuner.search.trial_record.TrialRecord: "knobs", "summary",
"feasible", "reason", "trial_dir", "simulated", "capacity", ...); feasibility falls back to Optuna's "constraints"
system attr (all <= 0: feasible)."""

from __future__ import annotations

import datetime as dt
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from tuner.search.trial_record import CONSTRAINTS_ATTR, TrialRecord

optuna.logging.set_verbosity(optuna.logging.WARNING)

_STORAGES: dict[str, optuna.storages.BaseStorage] = {}


class StudyUnavailable(RuntimeError):
    """No storage given, a storage that does not exist yet, or no study in it: the Study page's empty state."""


@dataclass(frozen=True)
class TrialRow:
    number: int
    state: str  # COMPLETE, FAIL, PRUNED, RUNNING, WAITING
    value: float | None  # the objective (goodput, req/s), the first objective of a multi-objective study
    started: dt.datetime | None
    completed: dt.datetime | None
    params: dict[str, Any]
    feasible: bool
    reason: str | None
    throughput: float | None  # output tokens/s of the load test
    tbt_p99: float | None
    ttft_p99: float | None
    trial_dir: str | None
    simulated: bool
    knobs: dict[str, Any] = field(default_factory=dict)
    evidence: str = ""  # capacity objective: the capacity with its bracket, and the figures at it with intervals


@dataclass(frozen=True)
class StudyData:
    name: str
    direction: str
    user_attrs: dict[str, Any]
    rows: list[TrialRow]
    importances: dict[str, float]


def storage_file(url: str) -> Path | None:
    """The file behind a SQLite or journal storage spec (the forms tuner.search.study.open_storage accepts), else None."""
    if url.startswith("sqlite:///"):
        return Path(url[len("sqlite:///"):]).expanduser()
    if url.startswith("journal:"):
        return Path(url[len("journal:"):]).expanduser()
    if "://" not in url:
        return Path(url).expanduser()
    return None


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """The tuner's storage (tuner.search.study.open_storage: sqlite:///F, postgresql://..., journal:PATH, PATH.journal,
    PATH.db), except that a SQLite or journal file that does not exist is reported, not created."""
    from tuner.search.study import StorageError
    from tuner.search.study import open_storage as open_tuner_storage

    path = storage_file(url)
    if path is not None and not path.exists():
        raise StudyUnavailable(f"no study yet: {path} does not exist (run `tune` to create it)")
    if url in _STORAGES:  # the Study page rereads every few seconds: one connection pool per storage
        return _STORAGES[url]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # the tuner's heartbeat option
            storage = open_tuner_storage(url)
    except StorageError as error:
        raise StudyUnavailable(str(error)) from None
    _STORAGES[url] = storage
    return storage


def study_names(storage: optuna.storages.BaseStorage) -> list[str]:
    return [s.study_name for s in storage.get_all_studies()]


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return None if math.isnan(float(x)) else float(x)


def constraints(trial: optuna.trial.FrozenTrial) -> list[float]:
    """The trial's constraint values: a list under "constraints" (Optuna's constraints_func; the tuner also keeps
    it as a user attr) and/or one value per "constraints:<name>" (Optuna 5's Trial.set_constraint)."""
    values = list(trial.system_attrs.get(CONSTRAINTS_ATTR) or TrialRecord.from_trial(trial).constraints or [])
    values += [float(v) for k, v in trial.system_attrs.items() if k.startswith("constraints:")]
    return values


def trial_row(trial: optuna.trial.FrozenTrial) -> TrialRow:
    record = TrialRecord.from_trial(trial)
    summary = record.summary or {}
    if record.feasible is not None:
        feasible = record.feasible
    else:
        feasible = trial.state == optuna.trial.TrialState.COMPLETE and all(c <= 0 for c in constraints(trial))
    value = trial.values[0] if trial.values else None
    return TrialRow(number=trial.number, state=trial.state.name, value=_number(value), started=trial.datetime_start,
                    completed=trial.datetime_complete, params=dict(trial.params), feasible=feasible,
                    reason=record.reason, throughput=_number(summary.get("output_tokens_per_s")),
                    tbt_p99=_number(summary.get("tbt_p99")), ttft_p99=_number(summary.get("ttft_p99")),
                    trial_dir=record.trial_dir, simulated=record.simulated,
                    knobs=dict(record.knobs or {}), evidence=evidence_text(trial.user_attrs))


def evidence_text(attrs: dict[str, Any]) -> str:
    """``capacity 2.1 req/s (bracket 2.1-2.4, 4 probes) | at it: attainment 94% (88-98) met, ...`` ("" without)."""
    cap = TrialRecord.from_attrs(attrs).capacity or {}
    if not cap:
        return ""
    return str(cap.get("describe") or "") + (f" | at it: {cap['at_capacity']}" if cap.get("at_capacity") else "")


def load_study(storage_url: str, name: str | None = None) -> StudyData:
    """The study `name` (default: the most recently created one) with its trials and importances."""
    from dashboards.analysis import param_importances

    storage = open_storage(storage_url)
    names = study_names(storage)
    if not names:
        raise StudyUnavailable(f"no study yet in {storage_url} (run `tune` to create one)")
    if name is None:
        name = names[-1]
    elif name not in names:
        raise StudyUnavailable(f"no study named {name!r} in {storage_url}; studies: {', '.join(names)}")
    study = optuna.load_study(study_name=name, storage=storage)
    rows = [trial_row(t) for t in study.get_trials(deepcopy=False) if not TrialRecord.from_trial(t).surplus]
    return StudyData(name=name, direction=study.directions[0].name.lower(), user_attrs=dict(study.user_attrs),
                     rows=rows, importances=param_importances(study))
