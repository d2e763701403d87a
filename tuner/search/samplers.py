"""Samplers that do not see the engine's default-config trial.

`tune` measures the engine's default config as a study's first trial. That trial samples no parameters (the
default's knobs lie outside the search space: 64 sequences, a 512-token budget), so the intersection of all
trials' search spaces, which TPE's multivariate mode and the GP sampler model jointly, is empty as long as it is in
the study: TPE then falls back to independent (univariate) sampling and GP to random sampling, for the whole
study. `SamplerWithoutDefaultTrial` hands the wrapped sampler a view of the study without such trials.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from tuner.search.trial_record import ROLE_DEFAULT as ROLE_DEFAULT, TrialRecord


def _is_default(trial: FrozenTrial) -> bool:
    return TrialRecord.from_trial(trial).role == ROLE_DEFAULT and not trial.params


class StudyWithoutDefaultTrial(optuna.Study):
    """The study as a sampler reads it, minus the default-config trial; everything else is the study's own.

    A Study, so that it is what a sampler's methods take. It does not run ``Study.__init__`` (that would look the
    study up in its storage again at every sample): every attribute it does not have (the storage, the study's id,
    directions, thread-local trial cache) is the wrapped study's, and Study's own methods and properties
    (``trials``, ``get_trials``, ``best_trials``) read the trials through the filtered ``_get_trials``.
    """

    def __init__(self, study: optuna.Study) -> None:  # no super().__init__(): see the class's docstring
        self._study = study

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def _get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None,
                    use_cache: bool = False) -> list[FrozenTrial]:
        trials = self._study._get_trials(deepcopy=deepcopy, states=states, use_cache=use_cache)
        return [t for t in trials if not _is_default(t)]


class SamplerWithoutDefaultTrial(optuna.samplers.BaseSampler):
    """`base`, fed a study view without the default-config trial (see the module's docstring)."""

    def __init__(self, base: optuna.samplers.BaseSampler) -> None:
        self.base = base

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self.base.infer_relative_search_space(StudyWithoutDefaultTrial(study), trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return self.base.sample_relative(StudyWithoutDefaultTrial(study), trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self.base.sample_independent(StudyWithoutDefaultTrial(study), trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.base.before_trial(StudyWithoutDefaultTrial(study), trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        self.base.after_trial(StudyWithoutDefaultTrial(study), trial, state, values)

    def reseed_rng(self) -> None:
        self.base.reseed_rng()
