"""A tuning policy: the SLO, the knobs to search (bounds or choices), constraints between knobs, the sampler,
the trial count and durations, the workload and the offered rate. Loaded from YAML and validated; every error
names the field (``search_space.max_num_seqs.low: ...``).

The shipped default is ``policies/default.yaml`` (package data: :func:`default_policy_path`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from loadtest.durations import parse_duration

SAMPLERS = ("tpe", "gp", "random", "grid", "nsga2")
OBJECTIVES = ("goodput", "capacity")
# How TPE's first trials are chosen: "structured" (tuner.structured_start: a bisection over max_num_seqs, then steps
# of the other scheduling knobs around the feasibility boundary) or "random" (Optuna's random start-up).
STARTS = ("structured", "random")

# The engine knobs a policy may search or fix, with their value type (names as in DESIGN.md / the engine's
# config; the tuner talks to the engine only over HTTP, so it keeps its own table of what may be searched).
KNOB_TYPES: dict[str, type] = {
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "chunk_size": int,
    "prefill_token_ratio": float,
    "block_size": int,
    "num_kv_blocks": int,
    "kv_cache_bytes": int,
    "max_model_len": int,
    "preemption_mode": str,
    "enable_prefix_caching": bool,
    "scheduling_policy": str,
}

_CONSTRAINT = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*|[-+]?\d+(?:\.\d*)?)\s*(<=|>=)\s*"
                         r"([A-Za-z_][A-Za-z0-9_]*|[-+]?\d+(?:\.\d*)?)\s*$")


class PolicyError(ValueError):
    """A bad policy value; the message starts with the field's path."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path


@dataclass(frozen=True)
class KnobRange:
    """How one knob is searched: ``choices``, or ``low``..``high`` (ints or floats) with optional ``log``/``step``."""

    name: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] | None = None

    @property
    def kind(self) -> type:
        return KNOB_TYPES[self.name]

    def grid_values(self) -> list[Any]:
        """The values a grid search tries: the choices; a stepped range; powers of two for a log int range."""
        if self.choices is not None:
            return list(self.choices)
        assert self.low is not None and self.high is not None
        if self.step is not None:
            n = int(math.floor((self.high - self.low) / self.step + 1e-9)) + 1
            return [self.kind(self.low + i * self.step) for i in range(n)]
        if self.log and self.kind is int:
            values, v = [], int(self.low)
            while v <= self.high:
                values.append(v)
                v *= 2
            return values if values[-1] == self.high else values + [int(self.high)]
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
            out[self.left] = KNOB_TYPES[self.left](knobs[self.right] if isinstance(self.right, str) else self.right)
        elif isinstance(self.right, str):
            out[self.right] = KNOB_TYPES[self.right](knobs[self.left] if isinstance(self.left, str) else self.left)
        return out


@dataclass(frozen=True)
class SLOTargets:
    tbt_p99: float
    ttft_p99: float | None = None
    e2e_p99: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        return {"tbt_p99": self.tbt_p99, "ttft_p99": self.ttft_p99, "e2e_p99": self.e2e_p99}


@dataclass(frozen=True)
class WorkloadSpec:
    name: str = "mixed"
    length_scale: float = 1.0
    mix: str | None = None
    mix_weights: str | None = None
    time_scale: float | None = None
    trace_offset: float = 0.0  # seconds of the trace's own timeline to skip (traces often start sparse)
    max_context: int | None = None
    output_scale: float | None = None  # output lengths' own scale (None: length_scale scales outputs too)

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
    """How one measurement of a config at a rate is sized (tuner/measurement.py): windows of ``trial_duration``
    until its figures are decided at ``level``, at most ``cap`` seconds of windows."""

    level: float = 0.95      # two-sided confidence level of every interval, in (0.5, 1)
    min_gaps: int = 400      # a p99 TBT is judged only from this many pooled gaps on (>= 1)
    cap: float = 60.0        # seconds of measurement windows at most (>= trial_duration)


@dataclass(frozen=True)
class CapacityPolicy:
    """The per-config rate search (tuner/capacity.py)."""

    resolution: float = 0.15  # stop when the bracket's high/low <= 1 + resolution (> 0)
    max_probes: int = 6       # measurements per config at most (>= 1)
    start_rate: float = 1.0   # req/s of the first probe when nothing is known yet (> 0)


@dataclass(frozen=True)
class VerdictPolicy:
    """The paired, repeated comparison of the best configs with the default config (tuner/verdict.py)."""

    candidates: int = 2       # best configs re-measured beside the default (>= 1)
    max_rounds: int = 4       # paired rounds at most (>= 2)
    budget: float = 300.0     # seconds the rounds may take in all (> 0)


@dataclass(frozen=True)
class Policy:
    slo: SLOTargets
    search_space: tuple[KnobRange, ...]
    fixed: dict[str, Any] = field(default_factory=dict)
    constraints: tuple[Constraint, ...] = ()
    sampler: str = "tpe"
    start: str = "structured"
    objective: str = "goodput"
    trials: int = 10
    trial_duration: float = 20.0
    warmup: float = 3.0
    seed: int = 0
    workload: WorkloadSpec = WorkloadSpec()
    rate: float | None = None  # None = auto
    pruning: PruningSpec = PruningSpec()
    measurement: MeasurementPolicy = MeasurementPolicy()
    capacity: CapacityPolicy = CapacityPolicy()
    verdict: VerdictPolicy = VerdictPolicy()
    time_budget: float = 840.0  # capacity objective: seconds for the whole run; the engine's searches stop in time
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
                "trial_duration": self.trial_duration, "warmup": self.warmup, "seed": self.seed,
                "workload": self.workload.as_dict(), "rate": self.rate if self.rate is not None else "auto",
                "pruning": dataclasses.asdict(self.pruning), "measurement": dataclasses.asdict(self.measurement),
                "capacity": dataclasses.asdict(self.capacity), "verdict": dataclasses.asdict(self.verdict),
                "time_budget": self.time_budget,
                "source": self.source}


# ------------------------------------------------------------------------------------------------ parsing

def _mapping(value: Any, path: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PolicyError(path, f"must be a mapping, got {type(value).__name__}")
    return value


def _unknown(d: dict[str, Any], allowed: set[str], path: str) -> None:
    extra = sorted(set(map(str, d)) - allowed)
    if extra:
        prefix = f"{path}." if path else ""
        raise PolicyError(f"{prefix}{extra[0]}", f"unknown field; known: {', '.join(sorted(allowed))}")


def _duration(value: Any, path: str, required: bool = False) -> float | None:
    if value is None:
        if required:
            raise PolicyError(path, "is required (a duration such as 50ms)")
        return None
    try:
        seconds = parse_duration(value)
    except ValueError as error:
        raise PolicyError(path, str(error)) from None
    if seconds <= 0:
        raise PolicyError(path, f"must be > 0, got {value!r}")
    return seconds


def _number(value: Any, path: str, kind: type = float, low: float | None = None, high: float | None = None,
            low_open: bool = False) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and not float(value).is_integer()):
        raise PolicyError(path, f"must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    v = kind(value)
    if not math.isfinite(float(v)):
        raise PolicyError(path, f"must be finite, got {value!r}")
    if low is not None and (v <= low if low_open else v < low):
        raise PolicyError(path, f"must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and v > high:
        raise PolicyError(path, f"must be <= {high}, got {value!r}")
    return v


def knob_value(name: str, value: Any, path: str) -> Any:
    """``value`` checked and converted to knob ``name``'s type; a PolicyError names ``path`` (a field or a flag)."""
    kind = KNOB_TYPES[name]
    if name == "chunk_size" and value is None:
        return None
    if kind is bool:
        if not isinstance(value, bool):
            raise PolicyError(path, f"must be true or false, got {value!r}")
        return value
    if kind is str:
        if not isinstance(value, str):
            raise PolicyError(path, f"must be a string, got {value!r}")
        return value
    low = 0.0 if kind is float else 1
    return _number(value, path, kind, low=low, low_open=kind is float)


def _knob_range(name: str, spec: Any, path: str) -> KnobRange:
    if name not in KNOB_TYPES:
        raise PolicyError(path, f"unknown knob; searchable knobs: {', '.join(KNOB_TYPES)}")
    if isinstance(spec, list):
        spec = {"choices": spec}
    spec = _mapping(spec, path)
    _unknown(spec, {"low", "high", "log", "step", "choices"}, path)
    if "choices" in spec:
        if set(spec) - {"choices"}:
            raise PolicyError(path, "give either `choices` or `low`/`high`, not both")
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise PolicyError(f"{path}.choices", "must be a non-empty list")
        values = tuple(knob_value(name, v, f"{path}.choices[{i}]") for i, v in enumerate(choices))
        if len(set(values)) != len(values):
            raise PolicyError(f"{path}.choices", "has duplicates")
        return KnobRange(name, choices=values)
    kind = KNOB_TYPES[name]
    if kind not in (int, float):
        raise PolicyError(path, f"a {kind.__name__} knob needs `choices`")
    for key in ("low", "high"):
        if key not in spec:
            raise PolicyError(f"{path}.{key}", "is required (or give `choices`)")
    low = knob_value(name, spec["low"], f"{path}.low")
    high = knob_value(name, spec["high"], f"{path}.high")
    if low > high:
        raise PolicyError(f"{path}.low", f"must be <= high ({high}), got {low}")
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise PolicyError(f"{path}.log", f"must be true or false, got {log!r}")
    step = spec.get("step")
    if step is not None:
        step = _number(step, f"{path}.step", kind, low=0, low_open=True)
        if log:
            raise PolicyError(f"{path}.step", "cannot be combined with log: true")
    return KnobRange(name, low=low, high=high, log=log, step=step)


def _constraint(text: Any, path: str) -> Constraint:
    if not isinstance(text, str):
        raise PolicyError(path, f"must be a string such as 'chunk_size <= max_num_batched_tokens', got {text!r}")
    m = _CONSTRAINT.match(text)
    if not m:
        raise PolicyError(path, f"cannot parse {text!r}: use 'KNOB <= KNOB', 'KNOB >= KNOB' or a number on one side")
    sides: list[str | float] = []
    for raw in (m.group(1), m.group(3)):
        if raw[0].isalpha() or raw[0] == "_":
            if raw not in KNOB_TYPES:
                raise PolicyError(path, f"unknown knob {raw!r}; knobs: {', '.join(KNOB_TYPES)}")
            if KNOB_TYPES[raw] not in (int, float):
                raise PolicyError(path, f"knob {raw!r} is not numeric")
            sides.append(raw)
        else:
            sides.append(float(raw))
    if not any(isinstance(s, str) for s in sides):
        raise PolicyError(path, "needs at least one knob")
    return Constraint(sides[0], m.group(2), sides[1])


def _rate(value: Any, path: str) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise PolicyError(path, f"must be a number of requests/s or 'auto', got {value!r}") from None
    return _number(value, path, float, low=0, low_open=True)


TOP_FIELDS = {"slo", "search_space", "fixed", "constraints", "sampler", "start", "objective", "trials",
              "trial_duration", "warmup", "seed", "workload", "rate", "pruning", "measurement", "capacity",
              "verdict", "time_budget", "guardrails", "triggers", "name",
              "description"}


def parse_policy(data: Any, source: str = "<dict>") -> Policy:
    """A validated Policy from a parsed YAML document. ``guardrails``/``triggers`` (the controller's) pass through
    unread here."""
    data = _mapping(data, "policy")
    _unknown(data, TOP_FIELDS, "")
    slo = _mapping(data.get("slo"), "slo")
    _unknown(slo, {"tbt_p99", "ttft_p99", "e2e_p99"}, "slo")
    targets = SLOTargets(tbt_p99=_duration(slo.get("tbt_p99"), "slo.tbt_p99", required=True),  # type: ignore[arg-type]
                         ttft_p99=_duration(slo.get("ttft_p99"), "slo.ttft_p99"),
                         e2e_p99=_duration(slo.get("e2e_p99"), "slo.e2e_p99"))
    space_raw = _mapping(data.get("search_space"), "search_space")
    if not space_raw:
        raise PolicyError("search_space", "must name at least one knob to search")
    space = tuple(_knob_range(str(k), v, f"search_space.{k}") for k, v in space_raw.items())
    fixed_raw = _mapping(data.get("fixed"), "fixed")
    fixed: dict[str, Any] = {}
    for k, v in fixed_raw.items():
        if k not in KNOB_TYPES:
            raise PolicyError(f"fixed.{k}", f"unknown knob; knobs: {', '.join(KNOB_TYPES)}")
        if k in space_raw:
            raise PolicyError(f"fixed.{k}", "is also in search_space")
        fixed[str(k)] = knob_value(str(k), v, f"fixed.{k}")
    constraints_raw = data.get("constraints") or []
    if not isinstance(constraints_raw, list):
        raise PolicyError("constraints", "must be a list of strings")
    constraints = tuple(_constraint(c, f"constraints[{i}]") for i, c in enumerate(constraints_raw))
    sampler = data.get("sampler", "tpe")
    if sampler not in SAMPLERS:
        raise PolicyError("sampler", f"must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    start = data.get("start", "structured")
    if start not in STARTS:
        raise PolicyError("start", f"must be one of {', '.join(STARTS)}, got {start!r}")
    objective = data.get("objective", "goodput")
    if objective not in OBJECTIVES:
        raise PolicyError("objective", f"must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    wl = _mapping(data.get("workload"), "workload")
    _unknown(wl, {f.name for f in dataclasses.fields(WorkloadSpec)}, "workload")
    name = wl.get("name", "mixed")
    if not isinstance(name, str) or not name:
        raise PolicyError("workload.name", f"must be 'mixed' or a trace file path, got {name!r}")
    workload = WorkloadSpec(
        name=name,
        length_scale=_number(wl.get("length_scale", 1.0), "workload.length_scale", float, low=0, low_open=True),
        mix=_str_or_none(wl.get("mix"), "workload.mix"),
        mix_weights=_str_or_none(wl.get("mix_weights"), "workload.mix_weights"),
        time_scale=None if wl.get("time_scale") is None else _number(wl["time_scale"], "workload.time_scale", float,
                                                                      low=0, low_open=True),
        trace_offset=_warmup_like(wl.get("trace_offset", 0), "workload.trace_offset"),
        max_context=None if wl.get("max_context") is None else _number(wl["max_context"], "workload.max_context",
                                                                        int, low=2),
        output_scale=None if wl.get("output_scale") is None else _number(wl["output_scale"], "workload.output_scale",
                                                                          float, low=0, low_open=True))
    pr = _mapping(data.get("pruning"), "pruning")
    _unknown(pr, {f.name for f in dataclasses.fields(PruningSpec)}, "pruning")
    enabled = pr.get("enabled", True)
    if not isinstance(enabled, bool):
        raise PolicyError("pruning.enabled", f"must be true or false, got {enabled!r}")
    pruning = PruningSpec(
        enabled=enabled,
        min_gaps=_number(pr.get("min_gaps", 100), "pruning.min_gaps", int, low=1),
        violation_share=_number(pr.get("violation_share", 0.05), "pruning.violation_share", float, low=0.01,
                                high=1.0),
        min_elapsed=_number(pr.get("min_elapsed", 0.3), "pruning.min_elapsed", float, low=0.0, high=1.0))
    trial_duration = _duration(data.get("trial_duration", "20s"), "trial_duration", required=True)
    assert trial_duration is not None
    measurement, capacity, verdict = _evidence_sections(data, trial_duration)
    policy = Policy(
        slo=targets, search_space=space, fixed=fixed, constraints=constraints, sampler=sampler, start=start,
        objective=objective,
        trials=_number(data.get("trials", 10), "trials", int, low=1),
        trial_duration=trial_duration,
        warmup=_warmup(data.get("warmup", "3s")),
        seed=_number(data.get("seed", 0), "seed", int, low=0),
        workload=workload, rate=_rate(data.get("rate", "auto"), "rate"), pruning=pruning, measurement=measurement,
        capacity=capacity, verdict=verdict, time_budget=_time_budget(data.get("time_budget", "14m"), verdict),
        source=source)
    if sampler == "grid":
        for k in space:
            k.grid_values()
    return policy


def _evidence_sections(data: dict[str, Any], trial_duration: float
                       ) -> tuple[MeasurementPolicy, CapacityPolicy, VerdictPolicy]:
    """The ``measurement``, ``capacity`` and ``verdict`` sections (each optional, defaults as in the dataclasses)."""
    ms = _mapping(data.get("measurement"), "measurement")
    _unknown(ms, {f.name for f in dataclasses.fields(MeasurementPolicy)}, "measurement")
    level = _number(ms.get("level", 0.95), "measurement.level", float, low=0.5, low_open=True)
    if level >= 1.0:
        raise PolicyError("measurement.level", f"must be < 1, got {level!r}")
    cap = _duration(ms.get("cap", "60s"), "measurement.cap", required=True)
    assert cap is not None
    if cap < trial_duration:
        raise PolicyError("measurement.cap", f"must be >= trial_duration ({trial_duration:g}s), got {cap:g}s")
    measurement = MeasurementPolicy(level=level, min_gaps=_number(ms.get("min_gaps", 400), "measurement.min_gaps",
                                                                  int, low=1), cap=cap)
    cs = _mapping(data.get("capacity"), "capacity")
    _unknown(cs, {f.name for f in dataclasses.fields(CapacityPolicy)}, "capacity")
    capacity = CapacityPolicy(
        resolution=_number(cs.get("resolution", 0.15), "capacity.resolution", float, low=0, low_open=True),
        max_probes=_number(cs.get("max_probes", 6), "capacity.max_probes", int, low=1),
        start_rate=_number(cs.get("start_rate", 1.0), "capacity.start_rate", float, low=0, low_open=True))
    vs = _mapping(data.get("verdict"), "verdict")
    _unknown(vs, {f.name for f in dataclasses.fields(VerdictPolicy)}, "verdict")
    budget = _duration(vs.get("budget", "5m"), "verdict.budget", required=True)
    assert budget is not None
    verdict = VerdictPolicy(candidates=_number(vs.get("candidates", 2), "verdict.candidates", int, low=1),
                            max_rounds=_number(vs.get("max_rounds", 4), "verdict.max_rounds", int, low=2),
                            budget=budget)
    return measurement, capacity, verdict


def _time_budget(value: Any, verdict: VerdictPolicy) -> float:
    budget = _duration(value, "time_budget", required=True)
    assert budget is not None
    if budget <= verdict.budget:
        raise PolicyError("time_budget", f"must be more than verdict.budget ({verdict.budget:g}s), got {budget:g}s")
    return budget


def _warmup(value: Any) -> float:
    return _warmup_like(value, "warmup")


def _warmup_like(value: Any, path: str) -> float:
    """A duration that may be 0."""
    try:
        return parse_duration(0 if value is None else value)
    except ValueError as error:
        raise PolicyError(path, str(error)) from None


def _str_or_none(value: Any, path: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise PolicyError(path, f"must be a string, got {value!r}")
    return value


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
        raise PolicyError(f"{path}: {error.field}", str(error).split(": ", 1)[1]) from None
