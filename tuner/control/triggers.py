"""The policy's triggers: SLO attainment stayed below its target (the attainment monitor's alarm:
tuner.control.attainment), the workload drifted (the drift monitor's alarm: tuner.control.drift), or a schedule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from policies.control import Triggers
from tuner.control.window import WindowStats


@dataclass(frozen=True)
class Trigger:
    kind: str  # "attainment" | "drift" | "schedule"
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "reason": self.reason, "evidence": self.evidence}


def attainment_trigger(alarm: dict[str, Any], stats: WindowStats, spec: Triggers) -> Trigger:
    """The attainment monitor's alarm (tuner.control.attainment) as a trigger; ``stats``: the trigger window."""
    look = alarm["look"]
    return Trigger("attainment", f"attainment stayed below the target {spec.attainment_target:.0%}: "
                                 f"{look['attaining']} of {look['finished']} requests in the last {look['seconds']:g}s "
                                 f"(CUSUM of the misses {alarm['cusum']:g} >= {alarm['threshold']:g} after "
                                 f"{alarm['looks']} looks, design effect {alarm['dispersion']:g}, tuned to a "
                                 f"{alarm['shortfall']:.0%} shortfall at {spec.attainment_alarms_per_hour:g} false "
                                 "alarms per hour)", {**alarm, "window": stats.as_dict()})


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


def first_trigger(stats: WindowStats | None, shortfall: dict[str, Any] | None, drift: dict[str, Any] | None,
                  now: float, last_retune: float | None, spec: Triggers) -> Trigger | None:
    """The first trigger that fires, in the order attainment, drift (the monitors' alarms), schedule."""
    return ((attainment_trigger(shortfall, stats, spec) if shortfall is not None and stats is not None else None)
            or (drift_trigger(drift, spec) if drift is not None else None)
            or schedule_trigger(now, last_retune, spec))
