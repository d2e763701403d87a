"""What ``tune`` keeps on each trial of its Optuna study (the trial's user attrs), in one place.

:class:`TrialRecord` is the per-trial record: one field per user attr, the field's name the attr's name in the
storage (SQLite, PostgreSQL, journal file), its value the attr's JSON value. The tuner stamps a trial in parts, each
by one function of this module: when it is enqueued (:func:`default_attrs`, :func:`start_attrs`,
:func:`screened_attrs`), when a process takes it (:func:`owner_attrs`, :func:`surplus_attrs`), while it runs
(:func:`heartbeat_attrs`) and when it is measured (:func:`measured_attrs`). Every reader goes through
:meth:`TrialRecord.from_trial`: an attr a trial does not carry reads as the field's default, one this version does not
know (a study written by another version) is left out, and one of the wrong JSON type reads as the default too.

The study's own user attrs (the SLO, the workload, the rate ...) are :class:`StudyRecord`, read and stamped the same
way (:func:`study_attrs`, :func:`rate_attrs`, :func:`design_seed_attrs`, :func:`simulator_vs_engine_attrs`).

The storage format is this module's field names and the JSON values: renaming a field breaks every existing study.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import optuna

# The trial's "role": how it came into the study. A trial the sampler proposed carries none (ROLE_SEARCH).
ROLE_SEARCH = "search"  # proposed by the sampler (no "role" attr)
ROLE_DEFAULT = "default"  # the engine's default config, measured once (tuner.search.study.enqueue_default)
ROLE_START = "start"  # a trial of the structured start (tuner.search.structured_start)
ROLE_SCREENED = "screened"  # a config the simulator's screen ranked high (tuner.search.screening, rescreen)


@dataclass(frozen=True)
class TrialRecord:
    """One trial's user attrs (see the module's docstring). None (False for a flag): not stamped on the trial."""

    # --- enqueued: how the trial came into the study
    role: str | None = None  # ROLE_DEFAULT / ROLE_START / ROLE_SCREENED; None: the sampler's (see `role_or_search`)
    start_step: str | None = None  # a start trial's part: "line" (max_num_seqs bisection) or "step" (boundary steps)
    screen_rank: int | None = None  # a screened config's place in the screen's ranking (1: the best)
    screen_scale: float | None = None  # the engine's speed factor of the ranking it was picked from (rescreen)
    screen_predicted: dict[str, Any] | None = None  # goodput screen: the simulator's summary figures (COMPARED)
    screen_predicted_capacity: float | None = None  # capacity screen: the typical draw's capacity, req/s
    screen_capacities: list[float] | None = None  # capacity screen: its capacity on each of the screen's draws
    screen_bound: str | None = None  # capacity screen: the SLO target that ended its capacity (None: none)
    # --- taken: which process runs it
    surplus: bool = False  # asked past the budget by a racing process and failed at once (the dashboard hides it)
    pid: int | None = None  # the process that runs it ...
    host: str | None = None  # ... on this machine (a dead pid there: the trial is an orphan)
    heartbeat: float | None = None  # wall-clock seconds of the running trial's last beat (orphans elsewhere)
    # --- measured: what its run found (knobs None: not measured, e.g. failed or still running)
    knobs: dict[str, Any] | None = None  # every knob applied (the full config, not only the searched ones)
    summary: dict[str, Any] | None = None  # the load test's summary (loadtest.summary), {} when none
    step_stats: dict[str, float] | None = None  # the engine's step statistics (tuner.trials.step_stats)
    feasible: bool | None = None  # whether the measurement met the SLO (None: not measured)
    reason: str | None = None  # why infeasible or failed (None when feasible)
    trial_dir: str | None = None  # the result folder of its (last) measurement window; "" when none
    steps_dir: str | None = None  # the folder all its windows lie under (a capacity trial's probes)
    simulated: bool = False  # measured on the simulator, not the engine
    pruned: bool = False  # stopped early by the pruner
    rate: float | None = None  # the offered rate it was measured at, req/s (capacity: the highest attaining one)
    constraints: list[float] | None = None  # one value per SLO target, <= 0: met (Optuna's constraints_func)
    capacity_probes: list[dict[str, Any]] | None = None  # capacity objective: every probe of its search
    capacity: dict[str, Any] | None = None  # capacity objective: tuner.measure.capacity.Capacity.as_dict()

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> TrialRecord:
        """The record of a trial's user attrs (or of a part of them, as enqueued)."""
        return cls(**_TRIAL.read(attrs))

    @classmethod
    def from_trial(cls, trial: optuna.trial.BaseTrial) -> TrialRecord:
        """The record of a trial (frozen, or one running in this process)."""
        return cls.from_attrs(trial.user_attrs)

    @property
    def role_or_search(self) -> str:
        """The role, ROLE_SEARCH for a trial the sampler proposed."""
        return self.role if self.role is not None else ROLE_SEARCH

    @property
    def measured(self) -> bool:
        """Whether its run was recorded (:func:`measured_attrs`)."""
        return self.knobs is not None


@dataclass(frozen=True)
class StudyRecord:
    """The study's own user attrs: what the tuner was asked for, as :class:`TrialRecord` for a trial."""

    slo: dict[str, Any] | None = None  # slotune.slo.SLO.as_dict()
    workload: dict[str, Any] | str | None = None  # the policy's WorkloadSpec.as_dict() (older studies: its name)
    objective: str | None = None  # "goodput" or "capacity" (the policy's objective)
    model: str | None = None  # the engine's model
    policy: dict[str, Any] | None = None  # the whole policy (policies.Policy.to_dict())
    rate: float | None = None  # goodput objective: the offered rate of every trial, req/s
    rate_reason: str | None = None  # goodput objective: why that rate (given, or --rate auto's probes)
    design_seed: int | None = None  # capacity objective: the seed of the screen's design, kept for a resume
    simulator_vs_engine: dict[str, Any] | None = None  # capacity objective: confirmation.simulator_error, its rows

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> StudyRecord:
        return cls(**_STUDY.read(attrs))

    @classmethod
    def from_study(cls, study: optuna.Study) -> StudyRecord:
        return cls.from_attrs(study.user_attrs)


def _accepted(hint: Any) -> tuple[type, ...]:
    """The JSON types a field of this type accepts (a float field takes an int too)."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = typing.get_args(hint) if union else (hint,)
    kinds = tuple(typing.get_origin(a) or a for a in args if a is not type(None))
    return kinds + ((int,) if float in kinds else ())


class _Schema:
    """A record class's attrs: each field's accepted JSON types and its default."""

    def __init__(self, cls: type) -> None:
        hints = typing.get_type_hints(cls)
        self.name = cls.__name__
        self.kinds = {f.name: _accepted(hints[f.name]) for f in fields(cls)}
        self.defaults = {f.name: f.default for f in fields(cls)}

    def read(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        """The fields' values from stored attrs: a missing one, or one of another JSON type, is the default; attrs
        of no field are left out."""
        return {name: self._value(name, attrs) for name in self.kinds}

    def _value(self, name: str, attrs: Mapping[str, Any]) -> Any:
        if name not in attrs:
            return self.defaults[name]
        value, kinds = attrs[name], self.kinds[name]
        if kinds == (bool,):
            return bool(value)  # truthiness, as the tuner always read its flags
        if isinstance(value, bool) and bool not in kinds:
            return self.defaults[name]  # not a number
        return value if isinstance(value, kinds) else self.defaults[name]

    def check(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """``attrs``, each name a field (a typo would write a new attr)."""
        unknown = sorted(attrs.keys() - self.kinds.keys())
        if unknown:
            raise KeyError(f"not a {self.name} field: {', '.join(unknown)}")
        return attrs


_TRIAL = _Schema(TrialRecord)
_STUDY = _Schema(StudyRecord)


def _stamp(**attrs: Any) -> dict[str, Any]:
    """``attrs`` as a trial's user attrs, checked."""
    return _TRIAL.check(attrs)


def _attr(name: str) -> str:
    """A field's name as an attr's, checked."""
    _stamp(**{name: None})
    return name


# The names code needs as keys: Optuna keeps constraints_func's values under the same name, as a system attr.
CONSTRAINTS_ATTR = _attr("constraints")
SURPLUS_ATTR = _attr("surplus")
START_STEP_ATTR = _attr("start_step")


def default_attrs() -> dict[str, Any]:
    """The default-config trial, as enqueued."""
    return _stamp(role=ROLE_DEFAULT)


def start_attrs(step: str) -> dict[str, Any]:
    """A trial of the structured start, as enqueued: its part ("line" or "step")."""
    return _stamp(role=ROLE_START, start_step=step)


def goodput_prediction(predicted: dict[str, Any]) -> dict[str, Any]:
    """The goodput screen's prediction of a config (screening.predicted), as a screened trial keeps it."""
    return _stamp(screen_predicted=predicted)


def capacity_prediction(typical: float, capacities: list[float], bound: str | None) -> dict[str, Any]:
    """The capacity screen's prediction of a config, as a screened trial keeps it."""
    return _stamp(screen_predicted_capacity=typical, screen_capacities=capacities, screen_bound=bound)


def screened_attrs(rank: int, prediction: Mapping[str, Any], scale: float | None = None) -> dict[str, Any]:
    """A screened config, as enqueued: its rank (1: best), the ranking's speed factor (rescreen: given) and the
    prediction (:func:`goodput_prediction` or :func:`capacity_prediction`)."""
    scaled = _stamp(screen_scale=scale) if scale is not None else {}
    return _stamp(role=ROLE_SCREENED, screen_rank=rank, **scaled, **prediction)


def surplus_attrs() -> dict[str, Any]:
    return _stamp(surplus=True)


def owner_attrs(pid: int, host: str) -> dict[str, Any]:
    """The process that runs the trial."""
    return _stamp(pid=pid, host=host)


def heartbeat_attrs(now: float) -> dict[str, Any]:
    return _stamp(heartbeat=now)


def measured_attrs(*, knobs: dict[str, Any], summary: dict[str, Any], step_stats: dict[str, float], feasible: bool,
                   reason: str | None, trial_dir: str, steps_dir: str, simulated: bool, pruned: bool,
                   rate: float | None, constraints: list[float], capacity_probes: list[dict[str, Any]] | None = None,
                   capacity: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a measured trial keeps (capacity_probes and capacity only when given: the capacity objective)."""
    attrs = _stamp(knobs=knobs, summary=summary, step_stats=step_stats, feasible=feasible, reason=reason,
                   trial_dir=trial_dir, simulated=simulated, steps_dir=steps_dir, pruned=pruned, rate=rate,
                   constraints=constraints)
    if capacity_probes:
        attrs.update(_stamp(capacity_probes=capacity_probes))
    if capacity is not None:
        attrs.update(_stamp(capacity=capacity))
    return attrs


def study_attrs(*, slo: dict[str, Any], workload: dict[str, Any], objective: str, model: str | None,
                policy: dict[str, Any]) -> dict[str, Any]:
    """What the tuner was asked for, as the study keeps it (each run stamps it again)."""
    return _STUDY.check(dict(slo=slo, workload=workload, objective=objective, model=model, policy=policy))


def rate_attrs(rate: float, reason: str) -> dict[str, Any]:
    """The goodput objective's offered rate, and why (a resumed study keeps it)."""
    return _STUDY.check(dict(rate=rate, rate_reason=reason))


def design_seed_attrs(seed: int) -> dict[str, Any]:
    return _STUDY.check(dict(design_seed=seed))


def simulator_vs_engine_attrs(summary: dict[str, Any]) -> dict[str, Any]:
    return _STUDY.check(dict(simulator_vs_engine=summary))


def stamp(target: optuna.trial.BaseTrial | optuna.Study, attrs: Mapping[str, Any]) -> None:
    """Set ``attrs`` (one of this module's functions') on a trial, or on the study (the study's attrs)."""
    for name, value in attrs.items():
        target.set_user_attr(name, value)
