"""The warm start of a retune: the best feasible config of every study in the shared Optuna storage (the tuner's
studies, tuner.search.study), screened with the controller's own candidates."""

from __future__ import annotations

from typing import Any

import optuna
from sqlalchemy.exc import SQLAlchemyError

from tuner.search.study import best_trial, open_storage

MAX_STUDIES = 8  # the most recent studies read


def best_knobs(storage_spec: str) -> tuple[list[dict[str, Any]], str | None]:
    """The searched knobs of each study's best feasible trial, and a problem (None when the storage read)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        storage = open_storage(storage_spec)
        summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
        out: list[dict[str, Any]] = []
        for summary in sorted(summaries, key=lambda s: s.datetime_start.timestamp() if s.datetime_start else 0.0,
                              reverse=True)[:MAX_STUDIES]:
            best = best_trial(optuna.load_study(study_name=summary.study_name, storage=storage))
            if best is not None and isinstance(best.user_attrs.get("knobs"), dict):
                out.append(dict(best.user_attrs["knobs"]))
        return out, None
    except (SQLAlchemyError, OSError, ValueError, KeyError, RuntimeError) as error:
        return [], str(error)
