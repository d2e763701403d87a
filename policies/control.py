"""The controller's sections of a policy (``slotune control``): guardrails, triggers, canary and retune.

    guardrails: {bounds: {max_num_seqs: {low: 2, high: 16}}, max_change: {max_num_seqs: 2.0}, default_max_change: 2,
                 frozen: [block_size], cooldown: 60s}
    triggers:   {attainment_target: 0.9, window: 60s, min_requests: 40, drift_threshold: 0.3, drift_window: 60s,
                 drift_reference: 5m, drift_alarms_per_hour: 0.05,
                 attainment_alarms_per_hour: 0.05, schedule: null}
    canary:     {block: 20s, settle: 5s, level: 0.025, power: 0.8, min_effect: 0.1, max_window: 15m,
                 lease_margin: 30s, rollback_drop: 0.15, share: 0.5}
    retune:     {candidates: 48, draws: 8, headroom: 1.25, sim_duration: 30s, step_history: 300s}

Every error names its field; contradictions between fields (a bound outside the search space, a frozen knob with a
change limit, a canary whose shortest window is longer than its longest) are errors before anything runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BeforeValidator, Field, ValidationInfo, model_validator

from engine.knobs import KNOB_BY_NAME
from policies.schema import At, Doc, Duration, OptionalPositiveSeconds, PolicyError, PositiveSeconds, validate_as

if TYPE_CHECKING:
    from policies.policy import KnobRange

CONTROL_SECTIONS = ("guardrails", "triggers", "canary", "retune")


class ControlPolicyError(PolicyError):
    """A bad controller section; the message starts with the field's path (a PolicyError like any other)."""


@dataclass(frozen=True)
class Guardrails:
    """Where and how far the controller may move the knobs."""

    bounds: dict[str, tuple[float, float]] = field(default_factory=dict)  # knob -> (low, high), within search_space
    max_change: dict[str, float] = field(default_factory=dict)  # knob -> largest factor per move (new/old, >= 1)
    default_max_change: float = 2.0  # for numeric knobs not in max_change
    # knobs the controller never touches: a block_size change relays out the KV cache (every running sequence
    # recomputed) at each switch of a canary's blocks
    frozen: tuple[str, ...] = ("block_size",)
    cooldown: float = 60.0  # seconds between the end of one move (kept or rolled back) and the next canary

    def change_limit(self, knob: str) -> float:
        return self.max_change.get(knob, self.default_max_change)


@dataclass(frozen=True)
class Triggers:
    """When the controller retunes."""

    attainment_target: float = 0.9  # share of requests within the SLO
    window: float = 60.0  # one look of the attainment CUSUM (consecutive, non-overlapping); a retune reads the last
    min_requests: int = 40  # finished requests a look (windows merge until it holds them) or a retune's window needs
    # relative change of a shape quantity (rate, mean lengths) that counts as drift; for a length distribution, the
    # share of requests that changed length bucket (total variation distance)
    drift_threshold: float = 0.3
    drift_window: float = 60.0  # one look of the drift CUSUMs (consecutive, non-overlapping)
    drift_reference: float = 300.0  # the traffic after the last decision the looks are judged against
    drift_alarms_per_hour: float = 0.05  # false drift alarms per hour on stationary traffic, all CUSUMs together
    # false attainment alarms per hour on traffic that attains exactly the target (tuner/control/attainment.py)
    attainment_alarms_per_hour: float = 0.05
    schedule: float | None = None  # also retune every this many seconds (None: never on a schedule)


@dataclass(frozen=True)
class Canary:
    """How a candidate is tried live: a switchback against the applied config (tuner/control/canary.py), each of
    its blocks under an engine lease."""

    block: float = 20.0  # seconds of one config's turn
    settle: float = 5.0  # the start of each block left unmeasured (the config before's requests still finishing)
    level: float = 0.025  # the rate at which a candidate no better than the applied config is kept
    power: float = 0.8  # the chance the sized canary keeps a candidate that gains min_effect (or its predicted gain)
    min_effect: float = 0.10  # the smallest attainment gain the canary is sized to detect
    max_window: float = 900.0  # the longest canary: at most max_window / (2 block) pairs
    lease_margin: float = 30.0  # the candidate's lease = 2 block + this: a dead controller leaves nothing behind
    rollback_drop: float = 0.15  # roll back at once when attainment falls by more than this, beyond the noise
    # on a fleet: the share of its replicas that runs the candidate in a block (one replica at least); as many run
    # the applied config as its control, and the two groups trade within each pair
    share: float = 0.5

    @property
    def lease_s(self) -> float:
        """The candidate's lease from its PATCH: it may run two blocks in a row (a pair's second and the next
        pair's first), then the margin."""
        return 2 * self.block + self.lease_margin


# A canary is kept by either of two tests (attainment, and requests finished while the engine is backlogged), each
# at level / KEEP_ROUTES: together they spend the canary's one budget.
KEEP_ROUTES = 2
# A canary whose plan grows looks twice (at the planned pairs and at the end), each at half of its route's level.
KEEP_LOOKS = 2


# The retune's pick moves only when fresh simulator draws show its edge over the applied config: a one-sided
# sign-flip test of the draws' differences at this level (its smallest p is 2^-draws, so fewer than MIN_DRAWS draws
# could never show an edge).
REDRAW_LEVEL = 0.025
MIN_DRAWS = math.ceil(math.log2(1 / REDRAW_LEVEL) - 1e-9)


def min_pairs(level: float) -> int:
    """The fewest pairs with which a canary at ``level`` can be kept at all: each route's one-sided sign-flip test
    at level / KEEP_ROUTES (its smallest p is 2^-pairs)."""
    return max(1, math.ceil(math.log2(KEEP_ROUTES / level) - 1e-9))


@dataclass(frozen=True)
class Retune:
    """How candidates are found: screened in the simulator on the live workload's shape."""

    candidates: int = 48  # configs screened per retune (plus the study's best and the current one)
    draws: int = 8  # fresh simulations of the pick and the applied config, on common arrivals, that must confirm it
    headroom: float = 1.25  # screen at this multiple of the live arrival rate (prefer configs with room to spare)
    sim_duration: float = 30.0  # simulated seconds per screened config
    step_history: float = 300.0  # seconds of step records the step-time model is refitted on


@dataclass(frozen=True)
class ControlSpec:
    guardrails: Guardrails = Guardrails()
    triggers: Triggers = Triggers()
    canary: Canary = Canary()
    retune: Retune = Retune()


# ---------------------------------------------------------------------------------------- the sections' schema
# Each section's document (pydantic, as policies.schema): its defaults are the dataclass's; the guardrails are also
# checked against the validated search space, which the validation context carries.

def _names_are_strings(value: Any) -> Any:
    """None is an empty mapping; a mapping's keys must be strings (YAML allows numbers too)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise At(str(key), "field names must be strings")
    return value


def _none_is_empty(value: Any) -> Any:
    return [] if value is None else value


class SectionDoc(Doc):
    """A controller section: null is the defaults."""

    @model_validator(mode="before")
    @classmethod
    def _mapping(cls, data: Any) -> Any:
        return _names_are_strings(data)


class BoundDoc(SectionDoc):
    low: float = Field(ge=0)
    high: float = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> BoundDoc:
        if self.low > self.high:
            raise At("low", f"must be <= high ({self.high:g}), got {self.low:g}")
        return self


class GuardrailsDoc(SectionDoc):
    bounds: Annotated[dict[str, BoundDoc], BeforeValidator(_names_are_strings)] = {}
    max_change: Annotated[dict[str, Annotated[float, Field(gt=1)]], BeforeValidator(_names_are_strings)] = {}
    default_max_change: float = Field(Guardrails.default_max_change, gt=1)
    frozen: Annotated[list[str], BeforeValidator(_none_is_empty)] = list(Guardrails.frozen)
    cooldown: Duration = Guardrails.cooldown

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> GuardrailsDoc:
        context = info.context or {}
        space: dict[str, KnobRange] = context.get("space", {})
        knob_names: set[str] = context.get("knob_names", set(KNOB_BY_NAME))
        for i, k in enumerate(self.frozen):
            if k not in knob_names:
                raise At(f"frozen[{i}]", f"unknown knob {k!r}")
        if space and set(space) <= set(self.frozen):
            raise At("frozen", "freezes every searched knob: the controller could never move")
        for k, bound in self.bounds.items():
            self._check_bound(k, bound, space)
        for k in self.max_change:
            if k not in knob_names:
                raise At(f"max_change.{k}", "unknown knob")
            if k in self.frozen:
                raise At(f"max_change.{k}", f"contradicts guardrails.frozen: a frozen knob never changes{self._unfreeze(k)}")
        return self

    @staticmethod
    def _unfreeze(k: str) -> str:
        return f" ({k} is frozen by default: list in guardrails.frozen only the knobs to hold, e.g. [], to let it " \
               f"move)" if k in Guardrails.frozen else ""

    def _check_bound(self, k: str, bound: BoundDoc, space: dict[str, KnobRange]) -> None:
        if k not in space:
            raise At(f"bounds.{k}", "is not a searched knob (search_space names the knobs that may move)")
        if k in self.frozen:
            raise At(f"bounds.{k}", f"contradicts guardrails.frozen: a frozen knob has no bounds to move in"
                                    f"{self._unfreeze(k)}")
        searched = space[k]
        if not searched.overlaps(bound.low, bound.high):
            shown = str(list(searched.choices)) if searched.choices is not None else \
                f"[{searched.low}, {searched.high}]"
            raise At(f"bounds.{k}", f"[{bound.low:g}, {bound.high:g}] leaves no value of search_space.{k} {shown}")


class TriggersDoc(SectionDoc):
    attainment_target: float = Field(Triggers.attainment_target, gt=0, le=1)
    window: PositiveSeconds = Triggers.window
    min_requests: int = Field(Triggers.min_requests, ge=1)
    drift_threshold: float = Field(Triggers.drift_threshold, gt=0)
    drift_window: PositiveSeconds = Triggers.drift_window
    drift_reference: PositiveSeconds = Triggers.drift_reference
    drift_alarms_per_hour: float = Field(Triggers.drift_alarms_per_hour, gt=0, le=60)
    attainment_alarms_per_hour: float = Field(Triggers.attainment_alarms_per_hour, gt=0, le=60)
    schedule: OptionalPositiveSeconds = Triggers.schedule


class CanaryDoc(SectionDoc):
    block: PositiveSeconds = Canary.block
    settle: Duration = Canary.settle
    level: float = Field(Canary.level, gt=0, lt=0.5)
    power: float = Field(Canary.power, gt=0, lt=1)
    min_effect: float = Field(Canary.min_effect, gt=0, le=1)
    max_window: PositiveSeconds = Canary.max_window
    lease_margin: PositiveSeconds = Canary.lease_margin
    rollback_drop: float = Field(Canary.rollback_drop, ge=0, le=1)
    share: float = Field(Canary.share, gt=0, le=0.5)

    @model_validator(mode="after")
    def _windows(self) -> CanaryDoc:
        if self.settle >= self.block:
            raise At("settle", f"must be < canary.block ({self.block:g}s), got {self.settle:g}s: nothing of a block "
                               "would be measured")
        least = 2 * self.block * min_pairs(self.level)
        if self.max_window < least:
            raise At("max_window", f"must hold at least {min_pairs(self.level)} pairs of blocks ({least:g}s) for a "
                                   f"canary at level {self.level:g} to ever be kept, got {self.max_window:g}s")
        return self


class RetuneDoc(SectionDoc):
    candidates: int = Field(Retune.candidates, ge=1)
    draws: int = Field(Retune.draws, ge=MIN_DRAWS)
    headroom: float = Field(Retune.headroom, ge=1)
    sim_duration: PositiveSeconds = Retune.sim_duration
    step_history: PositiveSeconds = Retune.step_history


class ControlDoc(Doc):
    guardrails: GuardrailsDoc
    triggers: TriggersDoc
    canary: CanaryDoc
    retune: RetuneDoc


def parse_control(data: dict[str, Any], space: dict[str, KnobRange], knob_names: set[str]) -> ControlSpec:
    """The controller's sections of a parsed policy document, checked against its search space; raises
    ControlPolicyError naming the field."""
    try:
        doc = validate_as(ControlDoc, {section: data.get(section) for section in CONTROL_SECTIONS},
                          context={"space": space, "knob_names": knob_names})
    except PolicyError as error:
        raise ControlPolicyError(error.field, error.message) from None
    g = doc.guardrails
    guardrails = Guardrails(bounds={k: (b.low, b.high) for k, b in g.bounds.items()}, max_change=dict(g.max_change),
                            default_max_change=g.default_max_change, frozen=tuple(g.frozen), cooldown=g.cooldown)
    return ControlSpec(guardrails=guardrails, triggers=Triggers(**doc.triggers.model_dump()),
                       canary=Canary(**doc.canary.model_dump()), retune=Retune(**doc.retune.model_dump()))
