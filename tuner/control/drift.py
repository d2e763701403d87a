"""Drift judged over time: one CUSUM per quantity and direction on consecutive, non-overlapping looks (each
``triggers.drift_window`` long) against a reference, with a stated rate of false alarms per hour.

- **The reference** is the first ``triggers.drift_reference`` of traffic after the last decision (or the start),
  frozen once it holds ``triggers.min_requests`` requests; every decision starts a new one.
- **The quantities**: the arrival rate (a look's arrivals against the reference rate, Poisson), and for prompts and
  outputs the mean length and the mean log length (from the engine's length histograms, each bucket at its geometric
  middle): the mean sees lengths that grow, the log mean a mix that changes at the same mean (medium prompts
  replaced by short and long ones). A look's figure is standardised by its own variance plus the reference's.
- **Each CUSUM** is tuned to the shift ``triggers.drift_threshold`` (a rate or a mean length moved by that factor,
  either way): its reference value k is half that shift in standard units at the reference's traffic, and its
  threshold h gives an average run of looks without a false alarm, by Siegmund's approximation, that spends
  ``triggers.drift_alarms_per_hour`` over all the CUSUMs (Bonferroni over the six).
- **A change that persists**: one look adds at most half the threshold to a CUSUM, so an alarm needs at least two
  looks beyond the noise: one burst does not move the knobs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from scipy import optimize

from policies.control import Triggers
from tuner.control.shape import Shape
from tuner.control.window import Lengths

QUANTITIES = ("arrival_rate", "log_prompt", "log_output")
DIRECTIONS = ("up", "down")
MIN_LOOK_REQUESTS = 5  # a look's length figures are judged only with this many finished requests
# A judged look joins the reference this many looks later: a reference that grows keeps its estimation error from
# adding the same offset to every look for ever (a CUSUM sums that offset), and the lag leaves a real change the
# looks to alarm on before it is folded in.
REFERENCE_LAG = 5
REFERENCE_ALLOWANCE = 1.0
SIEGMUND = 1.166  # the overshoot correction of Siegmund's approximation (2 x 0.583)


def arl0(h: float, k: float) -> float:
    """Siegmund's approximation of a standard normal CUSUM's average run length without a change."""
    b = h + SIEGMUND
    return (math.exp(2 * k * b) - 2 * k * b - 1) / (2 * k * k)


@functools.lru_cache(maxsize=256)
def cusum_threshold(k: float, looks: float) -> float:
    """The threshold h whose average run without a change is ``looks`` looks (k >= 0.01)."""
    if arl0(0.0, k) >= looks:
        return 0.0
    highest = 300.0 / k - SIEGMUND  # exp(2 k b) stays within a float
    return float(optimize.brentq(lambda h: arl0(h, k) - looks, 0.0, highest))


def log_lengths(lengths: Lengths) -> tuple[float, float, int]:
    """(mean, variance, n) of the log length over a histogram's requests, each bucket at its geometric middle."""
    points = [(0.5 * (math.log(low) + math.log(high)), count) for low, high, count in lengths.ranges()]
    n = sum(c for _, c in points)
    if n <= 0:
        return math.nan, math.nan, 0
    mean = sum(x * c for x, c in points) / n
    return mean, sum(c * (x - mean) ** 2 for x, c in points) / n, round(n)


def figures(shape: Shape) -> dict[str, tuple[float, float, int]]:
    """Each quantity's (value, per-unit variance, units) of a window, on scales where a window's figure is close to
    normal far into its tails (a CUSUM's false alarms live there): the square root of the arrival rate (a Poisson
    count's variance-stabilising transform: variance 1/4 per second), and the mean log prompt and output lengths
    (per finished request)."""
    out = {"arrival_rate": (math.sqrt(max(shape.arrival_rate, 0.0)), 0.25, round(shape.seconds))}
    for name, lengths in (("prompt", shape.prompt_lengths), ("output", shape.output_lengths)):
        if lengths.n:
            out[f"log_{name}"] = log_lengths(lengths)
    return out


@dataclass
class DriftMonitor:
    spec: Triggers
    reference: Shape | None = None
    sums: dict[tuple[str, str], float] = field(default_factory=dict)
    runs: dict[tuple[str, str], int] = field(default_factory=dict)  # looks the CUSUM has stayed above zero
    looks: int = 0
    pending: list[Shape] = field(default_factory=list)  # judged looks not yet folded into the reference
    partial: Shape | None = None  # windows of a look that does not hold min_requests arrivals yet

    def reset(self) -> None:
        self.reference, self.sums, self.runs, self.looks, self.pending, self.partial = None, {}, {}, 0, [], None

    def shift(self, quantity: str, value: float) -> float:
        """The shift the CUSUMs are tuned to, on the quantity's scale."""
        t = self.spec.drift_threshold
        return math.log(1 + t) if quantity.startswith("log_") else value * (math.sqrt(1 + t) - 1)

    def threshold(self, k: float, look_s: float) -> float:
        """h for a CUSUM of reference value ``k`` judging looks of ``look_s`` seconds: its share of the false alarms
        per hour."""
        looks_per_hour = 3600.0 / max(look_s, 1e-9)
        budget = self.spec.drift_alarms_per_hour / (len(QUANTITIES) * len(DIRECTIONS))
        return cusum_threshold(round(min(max(k, 0.01), 20.0), 2), looks_per_hour / budget)

    def add(self, window: Shape) -> dict[str, Any] | None:
        """Feed one window (``triggers.drift_window`` long); the alarm's evidence when a CUSUM crossed its
        threshold after a persisting change. A look is judged once it holds ``triggers.min_requests`` arrivals
        (several windows at a low rate: the figures of a few requests are far from normal in their tails)."""
        look = window if self.partial is None else merged(self.partial, window)
        if look.requests < self.spec.min_requests:
            self.partial = look
            return None
        self.partial = None
        if self.reference is None or self.reference.seconds < self.spec.drift_reference \
                or self.reference.requests < self.spec.min_requests:
            self.reference = look if self.reference is None else merged(self.reference, look)
            return None
        self.looks += 1
        ref = figures(self.reference)
        self.pending.append(look)
        if len(self.pending) > REFERENCE_LAG:  # old enough that a change in it would have alarmed by now
            self.reference = merged(self.reference, self.pending.pop(0))
        alarm = None
        for quantity, (value, _, units) in figures(look).items():
            if quantity not in ref or (quantity != "arrival_rate" and units < MIN_LOOK_REQUESTS):
                continue
            r_value, r_variance, r_units = ref[quantity]
            # the look's figure against the reference's, each with its sampling variance (the traffic's as the
            # reference shows it)
            sd = math.sqrt(r_variance / max(units, 1) + r_variance / max(r_units, 1))
            if not (sd > 0 and math.isfinite(value)):
                continue
            # the reference's own error is one offset shared by every look, which a CUSUM would sum: k allows
            # REFERENCE_ALLOWANCE of its standard errors on top of half the shift
            allowance = REFERENCE_ALLOWANCE * math.sqrt(r_variance / max(r_units, 1)) / sd
            z, k = (value - r_value) / sd, 0.5 * self.shift(quantity, r_value) / sd + allowance
            h = self.threshold(k, look.seconds)
            for direction, sign in zip(DIRECTIONS, (1.0, -1.0)):
                key = (quantity, direction)
                # no one look carries the sum past h: it adds at most h / 2, so a change must last two looks
                self.sums[key] = max(0.0, self.sums.get(key, 0.0) + min(sign * z - k, h / 2))
                self.runs[key] = self.runs.get(key, 0) + 1 if self.sums[key] > 0 else 0
                if alarm is None and self.sums[key] > h:
                    alarm = {"quantity": quantity, "direction": direction, "cusum": round(self.sums[key], 3),
                             "threshold": round(h, 3), "k": round(k, 3), "looks_above_zero": self.runs[key],
                             "look": round(value, 4), "reference": round(r_value, 4), "looks": self.looks,
                             "alarms_per_hour": self.spec.drift_alarms_per_hour}
        return alarm


def merged(a: Shape, b: Shape) -> Shape:
    """Two consecutive windows as one."""
    return Shape(seconds=a.seconds + b.seconds, requests=a.requests + b.requests,
                 prompt_means=a.prompt_means + b.prompt_means, output_means=a.output_means + b.output_means,
                 prefix_hit_rate=a.prefix_hit_rate, prompt_lengths=a.prompt_lengths + b.prompt_lengths,
                 output_lengths=a.output_lengths + b.output_lengths)
