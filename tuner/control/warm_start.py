"""The warm start of a retune: the best feasible config of every study in the shared Optuna storage (the tuner's
studies, tuner.search.study), screened with the controller's own candidates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
from sqlalchemy.exc import SQLAlchemyError

from tuner.search.study import best_trial, open_storage
from tuner.search.trial_record import TrialRecord

MAX_STUDIES = 8  # the most recent studies read


def _missing_file(spec: str) -> Path | None:
    """The file of a file storage (SQLite, journal) that does not exist: opening it would create an empty one."""
    if spec.startswith("journal:"):
        path = spec[len("journal:"):]
    elif spec.startswith("sqlite:///"):
        path = spec[len("sqlite:///"):]
    elif "://" not in spec:
        path = spec
    else:
        return None
    file = Path(path).expanduser()
    return None if not path or file.exists() else file


def best_knobs(storage_spec: str) -> tuple[list[dict[str, Any]], str | None]:
    """The searched knobs of each study's best feasible trial (the most recent studies first), and a problem (None
    when the storage read). A storage without studies, or whose studies have no feasible trial, gives none; a file
    storage that does not exist is a problem, and is not created (a mistyped path must not pass for an empty
    storage)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    missing = _missing_file(storage_spec)
    if missing is not None:
        return [], f"{missing} does not exist"
    try:
        storage = open_storage(storage_spec)
        summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
        out: list[dict[str, Any]] = []
        for summary in sorted(summaries, key=lambda s: s.datetime_start.timestamp() if s.datetime_start else 0.0,
                              reverse=True)[:MAX_STUDIES]:
            best = best_trial(optuna.load_study(study_name=summary.study_name, storage=storage))
            knobs = TrialRecord.from_trial(best).knobs if best is not None else None
            if knobs is not None:
                out.append(dict(knobs))
        return out, None
    except (SQLAlchemyError, OSError, ValueError, KeyError, RuntimeError) as error:
        return [], str(error)
