"""The policy's triggers: SLO attainment missed over a window (its Clopper-Pearson interval entirely below the
target, with at least ``min_requests`` finished requests), the workload drifted (the drift monitor's alarm:
tuner.control.drift), or a schedule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from policies.control import Triggers
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


def drift_trigger(alarm: dict[str, Any], spec: Triggers) -> Trigger:
    """The drift monitor's alarm (tuner.control.drift) as a trigger."""
    scale = "square root of the arrival rate" if alarm["quantity"] == "arrival_rate" else \
        f"mean log {alarm['quantity'].removeprefix('log_')} length"
    return Trigger("drift", f"the workload drifted {alarm['direction']}: the {scale} moved from "
                            f"{alarm['reference']:g} to {alarm['look']:g} and stayed moved (CUSUM {alarm['cusum']:g} > "
                            f"{alarm['threshold']:g}, tuned to a {spec.drift_threshold:.0%} shift at "
                            f"{spec.drift_alarms_per_hour:g} false alarms per hour)", alarm)


def schedule_trigger(now: float, last_retune: float | None, spec: Triggers) -> Trigger | None:
    if spec.schedule is None or (last_retune is not None and now - last_retune < spec.schedule):
        return None
    return Trigger("schedule", f"scheduled retune (every {spec.schedule:g}s)", {"last_retune": last_retune})


def first_trigger(stats: WindowStats | None, drift: dict[str, Any] | None, now: float, last_retune: float | None,
                  spec: Triggers) -> Trigger | None:
    """The first trigger that fires, in the order attainment, drift (the monitor's alarm), schedule."""
    return ((attainment_trigger(stats, spec) if stats is not None else None)
            or (drift_trigger(drift, spec) if drift is not None else None)
            or schedule_trigger(now, last_retune, spec))
