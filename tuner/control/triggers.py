"""The policy's triggers: SLO attainment missed over a window (its Clopper-Pearson interval entirely below the
target, with at least ``min_requests`` finished requests), the workload's shape drifted beyond the threshold (the
arrival rate, the mean lengths and the length distributions, each by a test: see tuner.control.shape; the length
distributions with at least ``min_requests`` finished requests in each window), or a schedule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from policies.control import Triggers
from tuner.control.shape import Shape, drift_tests
from tuner.control.window import WindowStats
from tuner.measure.statistics import lower_verdict


@dataclass(frozen=True)
class Trigger:
    kind: str  # "attainment" | "drift" | "schedule"
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "reason": self.reason, "evidence": self.evidence}


def attainment_trigger(stats: WindowStats, spec: Triggers) -> Trigger | None:
    if stats.finished < spec.min_requests:
        return None
    att = stats.attainment
    if lower_verdict(att, spec.attainment_target) != "missed":
        return None
    return Trigger("attainment", f"attainment {att.format(unit='', scale=100)} % over {stats.seconds:.0f}s "
                                 f"({stats.finished} requests) is below the target {spec.attainment_target:.0%} "
                                 "beyond the noise", {"window": stats.as_dict(), "target": spec.attainment_target})


def drift_trigger(recent: Shape, reference: Shape | None, spec: Triggers) -> Trigger | None:
    if reference is None or min(recent.requests, reference.requests) < spec.min_requests:
        return None
    tests = drift_tests(recent, reference, spec.drift_threshold, spec.min_requests)
    moved = [t for t in tests if t.drifted]
    if not moved:
        return None
    what = ", ".join(t.describe() for t in moved)
    return Trigger("drift", f"the workload drifted beyond {spec.drift_threshold:.0%}: {what}",
                   {"tests": [t.as_dict() for t in tests], "recent": recent.as_dict(),
                    "reference": reference.as_dict()})


def schedule_trigger(now: float, last_retune: float | None, spec: Triggers) -> Trigger | None:
    if spec.schedule is None or (last_retune is not None and now - last_retune < spec.schedule):
        return None
    return Trigger("schedule", f"scheduled retune (every {spec.schedule:g}s)", {"last_retune": last_retune})


def first_trigger(stats: WindowStats | None, recent: Shape | None, reference: Shape | None, now: float,
                  last_retune: float | None, spec: Triggers) -> Trigger | None:
    """The first trigger that fires, in the order attainment, drift, schedule."""
    return ((attainment_trigger(stats, spec) if stats is not None else None)
            or (drift_trigger(recent, reference, spec) if recent is not None else None)
            or schedule_trigger(now, last_retune, spec))
