"""The controller's sections of a policy (``slotune control``): guardrails, triggers, canary and retune.

    guardrails: {bounds: {max_num_seqs: {low: 2, high: 16}}, max_change: {max_num_seqs: 2.0}, default_max_change: 2,
                 frozen: [block_size], cooldown: 60s}
    triggers:   {attainment_target: 0.9, window: 60s, min_requests: 40, drift_threshold: 0.3, drift_window: 60s,
                 schedule: null}
    canary:     {min_requests: 40, min_window: 20s, max_window: 120s, lease_margin: 30s, rollback_drop: 0.15}
    retune:     {candidates: 48, headroom: 1.25, sim_duration: 30s, step_history: 300s}

Every error names its field; contradictions between fields (a bound outside the search space, a frozen knob with a
change limit, a canary whose shortest window is longer than its longest) are errors before anything runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slotune.units import parse_duration

if TYPE_CHECKING:
    from policies.policy import KnobRange

CONTROL_SECTIONS = ("guardrails", "triggers", "canary", "retune")


class ControlPolicyError(ValueError):
    """A bad controller section; the message starts with the field's path (as policies.PolicyError)."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path


@dataclass(frozen=True)
class Guardrails:
    """Where and how far the controller may move the knobs."""

    bounds: dict[str, tuple[float, float]] = field(default_factory=dict)  # knob -> (low, high), within search_space
    max_change: dict[str, float] = field(default_factory=dict)  # knob -> largest factor per move (new/old, >= 1)
    default_max_change: float = 2.0  # for numeric knobs not in max_change
    frozen: tuple[str, ...] = ()  # knobs the controller never touches
    cooldown: float = 60.0  # seconds between the end of one move (kept or rolled back) and the next canary

    def change_limit(self, knob: str) -> float:
        return self.max_change.get(knob, self.default_max_change)


@dataclass(frozen=True)
class Triggers:
    """When the controller retunes."""

    attainment_target: float = 0.9  # share of requests within the SLO
    window: float = 60.0  # seconds of traffic the attainment trigger judges
    min_requests: int = 40  # finished requests a window needs before it decides anything
    # relative change of a shape quantity (rate, mean lengths) that counts as drift; for a length distribution, the
    # share of requests that changed length bucket (total variation distance)
    drift_threshold: float = 0.3
    drift_window: float = 60.0  # the recent window compared with the reference one (the shape when last tuned)
    schedule: float | None = None  # also retune every this many seconds (None: never on a schedule)


@dataclass(frozen=True)
class Canary:
    """How a candidate is tried live (with an engine lease) and judged against the window before it."""

    min_requests: int = 40  # finished requests the canary needs before it can be kept
    min_window: float = 20.0
    max_window: float = 120.0  # at the end without a verdict: roll back
    lease_margin: float = 30.0  # lease = max_window + this: the engine reverts by itself if we never confirm
    rollback_drop: float = 0.15  # roll back at once when attainment falls by more than this, beyond the noise

    @property
    def lease_s(self) -> float:
        return self.max_window + self.lease_margin


@dataclass(frozen=True)
class Retune:
    """How candidates are found: screened in the simulator on the live workload's shape."""

    candidates: int = 48  # configs screened per retune (plus the study's best and the current one)
    headroom: float = 1.25  # screen at this multiple of the live arrival rate (prefer configs with room to spare)
    sim_duration: float = 30.0  # simulated seconds per screened config
    step_history: float = 300.0  # seconds of step records the step-time model is refitted on


@dataclass(frozen=True)
class ControlSpec:
    guardrails: Guardrails = Guardrails()
    triggers: Triggers = Triggers()
    canary: Canary = Canary()
    retune: Retune = Retune()


# ------------------------------------------------------------------------------------------------ parsing

def _mapping(value: Any, path: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ControlPolicyError(path, f"must be a mapping, got {type(value).__name__}")
    extra = [str(k) for k in value if not isinstance(k, str)]
    if extra:
        raise ControlPolicyError(f"{path}.{extra[0]}", "field names must be strings")
    return value


def _only(d: dict[str, Any], allowed: set[str], path: str) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        raise ControlPolicyError(f"{path}.{extra[0]}", f"unknown field; known: {', '.join(sorted(allowed))}")


def _seconds(value: Any, path: str, allow_zero: bool = False) -> float:
    try:
        seconds = parse_duration(value)
    except ValueError as error:
        raise ControlPolicyError(path, str(error)) from None
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise ControlPolicyError(path, f"must be {'>=' if allow_zero else '>'} 0, got {value!r}")
    return seconds


def _num(value: Any, path: str, low: float, high: float = math.inf, integer: bool = False,
         low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ControlPolicyError(path, f"must be a finite number, got {value!r}")
    if integer and not float(value).is_integer():
        raise ControlPolicyError(path, f"must be an integer, got {value!r}")
    if (value <= low if low_open else value < low) or value > high:
        bound = f"{'>' if low_open else '>='} {low:g}" + ("" if math.isinf(high) else f" and <= {high:g}")
        raise ControlPolicyError(path, f"must be {bound}, got {value!r}")
    return float(value)


def _guardrails(raw: Any, space: dict[str, KnobRange], knob_names: set[str]) -> Guardrails:
    d = _mapping(raw, "guardrails")
    _only(d, {"bounds", "max_change", "default_max_change", "frozen", "cooldown"}, "guardrails")
    frozen_raw = d.get("frozen") or []
    if not isinstance(frozen_raw, list) or not all(isinstance(k, str) for k in frozen_raw):
        raise ControlPolicyError("guardrails.frozen", f"must be a list of knob names, got {frozen_raw!r}")
    for i, k in enumerate(frozen_raw):
        if k not in knob_names:
            raise ControlPolicyError(f"guardrails.frozen[{i}]", f"unknown knob {k!r}")
    frozen = tuple(frozen_raw)
    if space and set(space) <= set(frozen):
        raise ControlPolicyError("guardrails.frozen", "freezes every searched knob: the controller could never move")
    bounds: dict[str, tuple[float, float]] = {}
    for k, spec in _mapping(d.get("bounds"), "guardrails.bounds").items():
        path = f"guardrails.bounds.{k}"
        if k not in space:
            raise ControlPolicyError(path, "is not a searched knob (search_space names the knobs that may move)")
        if k in frozen:
            raise ControlPolicyError(path, "contradicts guardrails.frozen: a frozen knob has no bounds to move in")
        spec = _mapping(spec, path)
        _only(spec, {"low", "high"}, path)
        if "low" not in spec or "high" not in spec:
            raise ControlPolicyError(path, "needs both low and high")
        low, high = _num(spec["low"], f"{path}.low", 0.0), _num(spec["high"], f"{path}.high", 0.0)
        if low > high:
            raise ControlPolicyError(f"{path}.low", f"must be <= high ({high:g}), got {low:g}")
        searched = space[k]
        if searched.choices is not None:
            overlap = any(isinstance(v, (int, float)) and low <= v <= high for v in searched.choices)
            shown = str(list(searched.choices))
        else:
            overlap = max(low, float(searched.low or 0)) <= min(high, float(searched.high or 0))
            shown = f"[{searched.low}, {searched.high}]"
        if not overlap:
            raise ControlPolicyError(path, f"[{low:g}, {high:g}] leaves no value of search_space.{k} {shown}")
        bounds[k] = (low, high)
    max_change: dict[str, float] = {}
    for k, v in _mapping(d.get("max_change"), "guardrails.max_change").items():
        path = f"guardrails.max_change.{k}"
        if k not in knob_names:
            raise ControlPolicyError(path, "unknown knob")
        if k in frozen:
            raise ControlPolicyError(path, "contradicts guardrails.frozen: a frozen knob never changes")
        max_change[k] = _num(v, path, 1.0, low_open=True)
    return Guardrails(bounds=bounds, max_change=max_change,
                      default_max_change=_num(d.get("default_max_change", 2.0), "guardrails.default_max_change", 1.0,
                                              low_open=True),
                      frozen=frozen, cooldown=_seconds(d.get("cooldown", "60s"), "guardrails.cooldown", True))


def _triggers(raw: Any) -> Triggers:
    d = _mapping(raw, "triggers")
    _only(d, {"attainment_target", "window", "min_requests", "drift_threshold", "drift_window", "schedule"},
          "triggers")
    schedule = d.get("schedule")
    return Triggers(
        attainment_target=_num(d.get("attainment_target", 0.9), "triggers.attainment_target", 0.0, 1.0,
                               low_open=True),
        window=_seconds(d.get("window", "60s"), "triggers.window"),
        min_requests=int(_num(d.get("min_requests", 40), "triggers.min_requests", 1, integer=True)),
        drift_threshold=_num(d.get("drift_threshold", 0.3), "triggers.drift_threshold", 0.0, low_open=True),
        drift_window=_seconds(d.get("drift_window", "60s"), "triggers.drift_window"),
        schedule=None if schedule is None else _seconds(schedule, "triggers.schedule"))


def _canary(raw: Any) -> Canary:
    d = _mapping(raw, "canary")
    _only(d, {"min_requests", "min_window", "max_window", "lease_margin", "rollback_drop"}, "canary")
    c = Canary(min_requests=int(_num(d.get("min_requests", 40), "canary.min_requests", 1, integer=True)),
               min_window=_seconds(d.get("min_window", "20s"), "canary.min_window"),
               max_window=_seconds(d.get("max_window", "120s"), "canary.max_window"),
               lease_margin=_seconds(d.get("lease_margin", "30s"), "canary.lease_margin"),
               rollback_drop=_num(d.get("rollback_drop", 0.15), "canary.rollback_drop", 0.0, 1.0))
    if c.min_window > c.max_window:
        raise ControlPolicyError("canary.min_window", f"must be <= canary.max_window ({c.max_window:g}s), got "
                                                      f"{c.min_window:g}s")
    return c


def _retune(raw: Any) -> Retune:
    d = _mapping(raw, "retune")
    _only(d, {"candidates", "headroom", "sim_duration", "step_history"}, "retune")
    return Retune(candidates=int(_num(d.get("candidates", 48), "retune.candidates", 1, integer=True)),
                  headroom=_num(d.get("headroom", 1.25), "retune.headroom", 1.0),
                  sim_duration=_seconds(d.get("sim_duration", "30s"), "retune.sim_duration"),
                  step_history=_seconds(d.get("step_history", "300s"), "retune.step_history"))


def parse_control(data: dict[str, Any], space: dict[str, KnobRange], knob_names: set[str]) -> ControlSpec:
    """The controller's sections of a parsed policy document, checked against its search space."""
    return ControlSpec(guardrails=_guardrails(data.get("guardrails"), space, knob_names),
                       triggers=_triggers(data.get("triggers")), canary=_canary(data.get("canary")),
                       retune=_retune(data.get("retune")))
