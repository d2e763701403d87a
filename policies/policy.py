"""A tuning policy: the SLO, the knobs to search (bounds or choices), constraints between knobs, the sampler,
the trial count and durations, the workload and the offered rate. Loaded from YAML and validated by the schema in
``policies.schema`` (pydantic, derived from the engine's knob table); every error names the field
(``search_space.max_num_seqs.low: ...``).

The shipped default is ``policies/default.yaml`` (package data: :func:`default_policy_path`), the one home of every
default: a policy file is read over it (:func:`with_shipped_defaults`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, get_args

import yaml

from engine.knobs import KNOB_BY_NAME
from slotune.slo import SLO
from policies.control import CONTROL_SECTIONS, ControlSpec, parse_control
from policies.schema import Objective, PolicyDoc, PolicyError, Sampler, Start, validate_document

SAMPLERS: tuple[str, ...] = get_args(Sampler)
OBJECTIVES: tuple[str, ...] = get_args(Objective)
STARTS: tuple[str, ...] = get_args(Start)


@dataclass(frozen=True)
class Choices:
    """A knob searched over listed values (any kind: numbers, names, booleans)."""

    values: tuple[Any, ...]


@dataclass(frozen=True)
class IntRange:
    """An integer knob searched over ``low``..``high`` (both included), every ``step``-th value when given."""

    low: int
    high: int
    log: bool = False
    step: int | None = None

    def values(self) -> list[int]:
        """Every value of the range in increasing order (every integer when there is no step)."""
        return list(range(self.low, self.high + 1, self.step or 1))


@dataclass(frozen=True)
class FloatRange:
    """A float knob searched over ``low``..``high``, on a grid of ``step`` when given."""

    low: float
    high: float
    log: bool = False
    step: float | None = None


Domain = Choices | IntRange | FloatRange


@dataclass(frozen=True)
class KnobRange:
    """How one knob is searched: ``choices``, or ``low``..``high`` (ints or floats) with optional ``log``/``step``.
    :attr:`domain` is the same, typed by its kind (the choices, an integer range or a float range)."""

    name: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        if self.choices is None and (self.low is None or self.high is None):
            raise PolicyError(f"search_space.{self.name}", "needs `choices` or both `low` and `high`")

    @property
    def kind(self) -> type:
        return KNOB_BY_NAME[self.name].type

    @property
    def domain(self) -> Domain:
        """The choices, or the range typed as the knob's kind (an int range for an integer knob)."""
        if self.choices is not None:
            return Choices(self.choices)
        assert self.low is not None and self.high is not None  # __post_init__: a range has both
        if self.kind is int:
            return IntRange(int(self.low), int(self.high), self.log, None if self.step is None else int(self.step))
        return FloatRange(float(self.low), float(self.high), self.log, None if self.step is None else float(self.step))

    def overlaps(self, low: float, high: float) -> bool:
        """Whether a value of the knob lies in ``low``..``high`` (a choice that is no number never does)."""
        d = self.domain
        if isinstance(d, Choices):
            return any(isinstance(v, (int, float)) and low <= v <= high for v in d.values)
        return max(low, d.low) <= min(high, d.high)

    def grid_values(self) -> list[Any]:
        """The values a grid search tries: the choices; a stepped range; powers of two for a log int range."""
        d = self.domain
        if isinstance(d, Choices):
            return list(d.values)
        if d.step is not None:
            n = int(math.floor((d.high - d.low) / d.step + 1e-9)) + 1
            return [self.kind(d.low + i * d.step) for i in range(n)]
        if isinstance(d, IntRange) and d.log:
            values, v = [], d.low
            while v <= d.high:
                values.append(v)
                v *= 2
            return values if values[-1] == d.high else values + [d.high]
        raise PolicyError(f"search_space.{self.name}", "the grid sampler needs `choices` or a `step` "
                                                       "(or `log: true` for an integer range)")

    def to_dict(self) -> dict[str, Any]:
        if self.choices is not None:
            return {"choices": list(self.choices)}
        d: dict[str, Any] = {"low": self.low, "high": self.high}
        if self.log:
            d["log"] = True
        if self.step is not None:
            d["step"] = self.step
        return d


@dataclass(frozen=True)
class Constraint:
    """``left <= right`` or ``left >= right``; each side a knob name or a number."""

    left: str | float
    op: str
    right: str | float

    def __str__(self) -> str:
        return f"{self.left} {self.op} {self.right}"

    def value(self, knobs: dict[str, Any]) -> float | None:
        """How far the knobs break it (> 0: broken, <= 0: met); None when a side is unset (e.g. chunk_size None)."""
        a = knobs.get(self.left) if isinstance(self.left, str) else self.left
        b = knobs.get(self.right) if isinstance(self.right, str) else self.right
        if a is None or b is None:
            return None
        return float(a) - float(b) if self.op == "<=" else float(b) - float(a)

    def repair(self, knobs: dict[str, Any], searched: set[str]) -> dict[str, Any]:
        """Clamp the searched side so the constraint holds (the left side first); unchanged when already met."""
        v = self.value(knobs)
        if v is None or v <= 0:
            return knobs
        out = dict(knobs)
        if isinstance(self.left, str) and (self.left in searched or not isinstance(self.right, str)):
            out[self.left] = KNOB_BY_NAME[self.left].type(knobs[self.right] if isinstance(self.right, str) else self.right)
        elif isinstance(self.right, str):
            out[self.right] = KNOB_BY_NAME[self.right].type(knobs[self.left] if isinstance(self.left, str) else self.left)
        return out


@dataclass(frozen=True)
class WorkloadSpec:
    """A workload as the load generator and the simulator draw it. The record's own defaults mean "the workload as it
    is" (no scaling, the load generator's default mix): what the code that builds one from live traffic or a test
    wants. A policy's workload is another thing: a policy file that leaves a field of the shipped workload out gets
    the shipped default of ``default.yaml`` (lengths scaled by 0.125, outputs by 0.25); one that names another
    workload (a trace) gets these for the fields it leaves out, as the shipped scales are for the shipped workload."""

    name: str = "mixed"
    length_scale: float = 1.0
    mix: str | None = None
    mix_weights: str | None = None
    time_scale: float | None = None
    trace_offset: float = 0.0  # seconds of the trace's own timeline to skip (traces often start sparse)
    max_context: int | None = None
    output_scale: float | None = None  # output lengths' own scale (None: length_scale scales outputs too)

    @classmethod
    def of(cls, workload: WorkloadSpec | str) -> WorkloadSpec:
        """A workload record, from a record or a workload's name (the workload as it is)."""
        return workload if isinstance(workload, WorkloadSpec) else cls(name=workload)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PruningSpec:
    enabled: bool = True
    min_gaps: int = 100
    violation_share: float = 0.05
    min_elapsed: float = 0.3


@dataclass(frozen=True)
class MeasurementPolicy:
    """How one measurement of a config at a rate is sized (tuner/measure/measurement.py): windows of ``trial_duration``
    until its figures are decided at ``level``, at most ``cap`` seconds of windows."""

    level: float      # two-sided confidence level of every interval, in (0.5, 1)
    min_gaps: int     # a p99 TBT is judged only from this many pooled gaps on (>= 1)
    cap: float        # seconds of measurement windows at most (>= trial_duration)
    block: float      # seconds of arrivals per block, the unit of an attainment's evidence (> 0): longer than a
                      # queue episode (tuner/measure/dependence.py)
    busy: float | None  # cores other processes may take during a window before it is void (None: not judged)


@dataclass(frozen=True)
class CapacityPolicy:
    """The per-config rate search (tuner/measure/capacity.py)."""

    resolution: float  # stop when the searched bracket's high/low <= 1 + resolution (> 0), every config's
    max_probes: int    # measurements per config at most (>= 1)
    start_rate: float  # req/s of the first probe when nothing is known yet (> 0)


@dataclass(frozen=True)
class VerdictPolicy:
    """The paired, repeated comparison of the best configs with the default config (tuner/measure/verdict.py)."""

    candidates: int  # best configs re-measured beside the default (>= 1)
    max_rounds: int  # paired rounds at most (>= 2)
    budget: float    # seconds the rounds may take in all (> 0)
    window: float    # the default's sustained window at its own ceiling (> 0; tuner/measure/verdict_plan.py)


@dataclass(frozen=True)
class Policy:
    slo: SLO
    search_space: tuple[KnobRange, ...]
    fixed: dict[str, Any]
    constraints: tuple[Constraint, ...]
    sampler: str
    start: str
    objective: str
    trials: int
    trial_duration: float
    warmup: float
    server_warmup: float  # a server started per configuration: load it took before it is measured
    seed: int
    workload: WorkloadSpec
    rate: float | None  # None = auto
    pruning: PruningSpec
    measurement: MeasurementPolicy
    capacity: CapacityPolicy
    verdict: VerdictPolicy
    time_budget: float  # capacity objective: seconds for the whole run; the engine's searches stop in time
    control: ControlSpec = field(default_factory=ControlSpec)  # the controller's sections (policies.control)
    source: str = "<built-in>"

    @property
    def searched(self) -> set[str]:
        return {k.name for k in self.search_space}

    def knob(self, name: str) -> KnobRange:
        return next(k for k in self.search_space if k.name == name)

    def repair(self, knobs: dict[str, Any]) -> dict[str, Any]:
        """The knobs with every constraint made to hold (applied in order, twice for chains)."""
        for _ in range(2):
            for c in self.constraints:
                knobs = c.repair(knobs, self.searched)
        return knobs

    def replace(self, **changes: Any) -> "Policy":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {"slo": self.slo.as_dict(), "search_space": {k.name: k.to_dict() for k in self.search_space},
                "fixed": dict(self.fixed), "constraints": [str(c) for c in self.constraints],
                "sampler": self.sampler, "start": self.start, "objective": self.objective, "trials": self.trials,
                "trial_duration": self.trial_duration, "warmup": self.warmup,
                "server_warmup": self.server_warmup, "seed": self.seed,
                "workload": self.workload.as_dict(), "rate": self.rate if self.rate is not None else "auto",
                "pruning": dataclasses.asdict(self.pruning), "measurement": dataclasses.asdict(self.measurement),
                "capacity": dataclasses.asdict(self.capacity), "verdict": dataclasses.asdict(self.verdict),
                "time_budget": self.time_budget, "control": dataclasses.asdict(self.control),
                "source": self.source}


# ------------------------------------------------------------------------------------------------ parsing

def _in_order(given: Any, names: set[str]) -> list[str]:
    """`names` in the order the document gave them (the search space's order is the structured start's)."""
    return [str(k) for k in (given if isinstance(given, dict) else {}) if k in names]


def _policy(doc: PolicyDoc, data: dict[str, Any], source: str) -> Policy:
    ranges = {name: getattr(doc.search_space, name) for name in doc.search_space.model_fields_set}
    space = tuple(KnobRange(name, low=spec.low, high=spec.high, log=spec.log, step=spec.step,
                            choices=None if spec.choices is None else tuple(spec.choices))
                  for name in _in_order(data.get("search_space"), set(ranges)) if (spec := ranges[name]) is not None)
    fixed = {name: getattr(doc.fixed, name) for name in _in_order(data.get("fixed"), doc.fixed.model_fields_set)}
    workload = WorkloadSpec(**doc.workload.model_dump())
    return Policy(slo=doc.slo, search_space=space, fixed=fixed,
                  constraints=tuple(Constraint(*c) for c in doc.constraints), sampler=doc.sampler, start=doc.start,
                  objective=doc.objective, trials=doc.trials, trial_duration=doc.trial_duration, warmup=doc.warmup,
                  server_warmup=doc.server_warmup, seed=doc.seed, workload=workload, rate=doc.rate, pruning=PruningSpec(**doc.pruning.model_dump()),
                  measurement=MeasurementPolicy(**doc.measurement.model_dump()),
                  capacity=CapacityPolicy(**doc.capacity.model_dump()), verdict=VerdictPolicy(**doc.verdict.model_dump()),
                  time_budget=doc.time_budget, control=_control(data, space), source=source)


def _control(data: dict[str, Any], space: tuple[KnobRange, ...]) -> ControlSpec:
    return parse_control(data, {k.name: k for k in space}, set(KNOB_BY_NAME))  # a ControlPolicyError is a PolicyError


# Sections a policy may give field by field, each field it leaves out taking the shipped value. The search space,
# the fixed knobs and the constraints are given whole: a policy's own search space replaces the shipped one.
FIELDWISE_SECTIONS = ("slo", "workload", "pruning", "measurement", "capacity", "verdict") + CONTROL_SECTIONS


@functools.cache
def _shipped_document() -> dict[str, Any]:
    data = yaml.safe_load(default_policy_path().read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise PolicyError(str(default_policy_path()), "the shipped default policy must be a mapping")
    return data


def with_shipped_defaults(data: Any) -> Any:
    """``data`` read over the shipped default.yaml, the one home of every policy default: a top-level field it leaves
    out (or sets to null, for a section) takes the shipped value, and so does each field of a section it gives in
    part; only ``slo.tbt_p99`` is required. A workload other than the shipped one (a trace) takes WorkloadSpec's
    defaults (the workload as it is) for the fields it leaves out. Anything but a mapping is returned as it is, for
    the validation to reject."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return data
    merged = copy.deepcopy(_shipped_document())
    shipped_workload = merged["workload"]["name"]
    del merged["slo"]["tbt_p99"]  # the one field every policy gives itself: the target it is tuned for
    for key, value in data.items():
        if key in FIELDWISE_SECTIONS and value is None:
            continue
        if key == "workload" and isinstance(value, dict) and value.get("name", shipped_workload) != shipped_workload:
            merged[key] = {**WorkloadSpec().as_dict(), **value}  # the shipped scales are for the shipped workload
        elif key in FIELDWISE_SECTIONS and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def parse_policy(data: Any, source: str = "<dict>") -> Policy:
    """A validated Policy from a parsed YAML document read over the shipped defaults (the controller's sections:
    policies.control)."""
    data = with_shipped_defaults(data)
    policy = _policy(validate_document(data), data, source)
    if policy.sampler == "grid":
        for k in policy.search_space:
            k.grid_values()
    return policy


def default_policy_path() -> Path:
    return Path(str(resources.files("policies").joinpath("default.yaml")))


def load_policy(path: str | Path | None = None) -> Policy:
    """The policy in ``path`` (YAML), or the shipped default. Raises PolicyError naming the file and field."""
    path = Path(path) if path is not None else default_policy_path()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise PolicyError(str(path), f"cannot read: {error.strerror or error}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise PolicyError(str(path), f"not valid YAML: {error}") from None
    try:
        return parse_policy(data, source=str(path))
    except PolicyError as error:
        raise PolicyError(f"{path}: {error.field}", error.message) from None
