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

from tuner.search.trial_record import CONSTRAINTS_ATTR, StudyRecord, TrialRecord

optuna.logging.set_verbosity(optuna.logging.WARNING)

_STORAGES: dict[str, optuna.storages.BaseStorage] = {}


class StudyUnavailable(RuntimeError):
    """No storage given, a storage that does not exist yet, or no study in it: the Study page's empty state."""


@dataclass(frozen=True)
class TrialRow:
    number: int
    state: str  # COMPLETE, FAIL, PRUNED, RUNNING, WAITING
    value: float | None  # the objective (goodput or capacity, req/s), the first of a multi-objective study
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
    bracket: tuple[float, float | None] | None = None  # capacity objective: the searched bracket, req/s (None: open)


@dataclass(frozen=True)
class StudyData:
    name: str
    direction: str
    user_attrs: dict[str, Any]
    rows: list[TrialRow]
    importances: dict[str, float]
    objective: str = "goodput"  # "goodput" (at the study's rate) or "capacity" (each trial's highest rate served)
    importance_note: str = ""  # why there are no importances ("" when there are)


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
                    knobs=dict(record.knobs or {}), evidence=evidence_text(trial.user_attrs),
                    bracket=capacity_bracket(record.capacity))


def capacity_bracket(capacity: dict[str, Any] | None) -> tuple[float, float | None] | None:
    """A capacity record's searched bracket (low, high; high None where no rate read below the target), else None."""
    bracket = (capacity or {}).get("bracket")
    if not isinstance(bracket, list) or len(bracket) != 2:
        return None
    low, high = _number(bracket[0]), _number(bracket[1])
    return None if low is None else (low, high)


def study_objective(objective: str | None, rows: list[TrialRow]) -> str:
    """The study's objective as the tuner recorded it; a study without the record: capacity when a trial carries a
    capacity bracket, else goodput (the tuner's only objective before it recorded one)."""
    if objective == "goodput" or objective == "capacity":
        return objective
    return "capacity" if any(r.bracket is not None for r in rows) else "goodput"


def knobs_text(row: TrialRow, searched: list[str]) -> str:
    """The trial's knobs as the engine ran them (after the constraints' repair), the ``searched`` ones (every knob
    when none was searched); a value the repair changed says what was sampled. A trial not measured (running, or
    stopped before its run was recorded): its params, so marked."""
    if not row.knobs:
        shown = ", ".join(f"{k}={v}" for k, v in row.params.items())
        return f"{shown} (sampled; not measured)" if shown else ""
    names = [k for k in searched if k in row.knobs] or sorted(row.knobs)
    return ", ".join(f"{k}={row.knobs[k]}" + (f" (sampled {row.params[k]})" if k in row.params
                                               and row.params[k] != row.knobs[k] else "") for k in names)


def searched_names(rows: list[TrialRow]) -> list[str]:
    """The knobs the study searched (its trials' params), in the order they first appear."""
    return list(dict.fromkeys(k for r in rows for k in r.params))


def evidence_text(attrs: dict[str, Any]) -> str:
    """``capacity 2.1 req/s (bracket 2.1-2.4, 4 probes) | at it: attainment 94% (88-98) met, ...`` ("" without)."""
    cap = TrialRecord.from_attrs(attrs).capacity or {}
    if not cap:
        return ""
    return str(cap.get("describe") or "") + (f" | at it: {cap['at_capacity']}" if cap.get("at_capacity") else "")


def load_study(storage_url: str, name: str | None = None) -> StudyData:
    """The study `name` (default: the most recently created one) with its trials and importances."""
    from dashboards.analysis import importance_gap, param_importances

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
                     rows=rows, importances=param_importances(study),
                     objective=study_objective(StudyRecord.from_study(study).objective, rows),
                     importance_note=importance_gap(study))
