"""Capacity: the highest offered rate at which a config serves >= 90 % of its requests within the SLO, found by a
rate search that brackets it and bisects the bracket to a stated resolution.

The bracket is (low, high): ``low`` the highest rate a measurement showed served ("met"), ``high`` the lowest rate
it did not (missed, or undecided: not shown to serve; an undecided rate is where noise decides, the edge). The
search starts where what is known puts it (a neighbouring config's capacity, a simulator's prediction, the same
config's earlier bracket), grows or shrinks by ``step`` until both sides are found, going down as well as up, then
bisects geometrically until ``high / low <= 1 + resolution`` or the probes run out. The capacity is ``low``, with
the bracket as its interval: the figure a loadtest at that rate can check. Probe i of a search is on arrival draw
base + i, so that the bracket is not one draw's luck.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from policies import Policy
from tuner.measure.measurement import TARGET_SHARE, Measurement, MeasurementSpec, measure
from tuner.measure.statistics import Interval
from tuner.trials.trial_backend import TrialBackend

MIN_RATE = 0.02  # req/s: a config that does not serve this is infeasible at any rate


@dataclass
class Capacity:
    knobs: dict[str, Any]
    low: float = 0.0
    high: float = math.inf
    probes: list[Measurement] = field(default_factory=list)
    resolution: float = 0.15
    stopped: str = ""  # why the search ended
    # where the search began: probe i ran on arrival draw ``draw + i``; its first rate and step (a twin of the search,
    # in the simulator, starts there to see the same draws at the same rates while its verdicts agree)
    draw: int = 0
    start: float = 0.0
    step: float = 2.0

    @property
    def value(self) -> float:
        return self.low

    @property
    def bracket(self) -> list[float | None]:
        """[low, high]; high None where no rate probed was missed."""
        return [self.low, self.high if math.isfinite(self.high) else None]

    def narrow(self, rate: float, verdict: str) -> None:
        """The bracket after a probe at ``rate`` decided ``verdict`` (anything but met narrows it from above)."""
        if verdict == "met":
            self.low = max(self.low, rate)
        else:
            self.high = min(self.high, rate)
        if self.low > 0 and self.high <= self.low:  # a lower rate failed after a higher one served: noise; keep both
            self.high = self.low * (1 + self.resolution)

    @property
    def resolved(self) -> bool:
        return self.low > 0 and math.isfinite(self.high) and self.high / self.low <= 1 + self.resolution + 1e-9

    @property
    def feasible(self) -> bool:
        return self.low > 0

    @property
    def interval(self) -> Interval:
        """The bracket (low, high) around the capacity (high infinite: never exceeded)."""
        return Interval(self.low, self.low, self.high, 1.0, len(self.probes))

    @property
    def at_capacity(self) -> Measurement | None:
        """The measurement at ``low`` (the highest rate served), else the last one."""
        served = [m for m in self.probes if m.verdict == "met" and m.rate == self.low]
        return served[-1] if served else (self.probes[-1] if self.probes else None)

    @property
    def output_tokens_per_s(self) -> float | None:
        m = self.at_capacity
        return m.output_tokens_per_s if m is not None and m.verdict == "met" else None

    @property
    def bound(self) -> str:
        """What ends the capacity: ``ttft`` or ``tbt`` when at the lowest rate not served only that target's pooled
        p99 missed; empty when both did, neither did (attainment alone), or nothing was missed."""
        above = [m for m in self.probes if m.verdict != "met" and m.rate >= self.high and m.figures is not None]
        if not above:
            return ""
        verdicts = min(above, key=lambda m: m.rate).figures.verdicts  # type: ignore[union-attr]
        missed = {k for k in ("tbt_p99", "ttft_p99") if verdicts.get(k) == "missed"}
        return {frozenset({"tbt_p99"}): "tbt", frozenset({"ttft_p99"}): "ttft"}.get(frozenset(missed), "")

    @property
    def rejected(self) -> str | None:
        last = self.probes[-1] if self.probes else None
        reason = last.reason if last is not None else None
        return reason if reason and reason.startswith("rejected") else None

    def describe(self) -> str:
        """``3.1 req/s (bracket 3.1-3.4, 6 probes), 310 output tok/s``."""
        if not self.feasible:
            return (f"capacity 0 (no rate down to {self.high:.3g} req/s served; {self.stopped})" if self.probes
                    else "capacity not measured")
        high = f"{self.high:.3g}" if math.isfinite(self.high) else "?"
        toks = self.output_tokens_per_s
        return (f"capacity {self.low:.3g} req/s (bracket {self.low:.3g}-{high}, {len(self.probes)} probes)"
                + (f", {toks:.0f} output tok/s" if toks is not None else ""))

    def as_dict(self) -> dict[str, Any]:
        at = self.at_capacity
        return {"req_per_s": self.low, "bracket": self.bracket,
                "describe": self.describe(), "at_capacity": at.describe() if at is not None else None,
                "resolved": self.resolved, "output_tokens_per_s": self.output_tokens_per_s, "stopped": self.stopped,
                "bound": self.bound, "draw": self.draw, "start": self.start, "step": self.step,
                "probes": [probe_record(m) for m in self.probes]}


def probe_record(m: Measurement) -> dict[str, Any]:
    """A probe as the study keeps it: its rate, verdict, counts and line (the verdict pools the default's)."""
    f = m.figures
    return {"rate": m.rate, "verdict": m.verdict, "requests": f.requests if f else 0,
            "attaining": f.attaining if f else 0, "design_effect": f.design_effect if f else 1.0, "reason": m.reason,
            "output_tokens_per_s": m.output_tokens_per_s, "describe": m.describe()}


def next_rate(low: float, high: float, start: float, step: float) -> float:
    """The next probe: ``start`` with nothing known, a step beyond the one known side, else the geometric middle."""
    if low <= 0 and math.isinf(high):
        return start
    if math.isinf(high):
        return low * step
    if low <= 0:
        return high / step
    return math.sqrt(low * high)


def search_capacity(probe: Callable[[float], Measurement], knobs: dict[str, Any], start: float,
                    resolution: float = 0.15, max_probes: int = 6, step: float = 2.0,
                    on_probe: Callable[[Measurement], None] | None = None,
                    can_show_met: Callable[[float], bool] | None = None,
                    time_up: Callable[[], str | None] | None = None) -> Capacity:
    """Bracket and bisect the capacity of ``knobs``; ``probe(rate)`` measures it at a rate. ``can_show_met(rate)``
    (MeasurementSpec.can_show_met): whether a measurement at that rate holds enough requests to show the share met;
    with no rate served yet, the search does not go down to a rate that cannot. ``time_up()``: why no further probe
    may start (None: it may); the first probe always runs."""
    cap = Capacity(dict(knobs), resolution=resolution, start=start, step=step)
    while len(cap.probes) < max_probes:
        late = time_up() if time_up is not None and cap.probes else None
        if late:
            cap.stopped = late
            return cap
        rate = next_rate(cap.low, cap.high, start, step)
        if rate < MIN_RATE:
            cap.stopped = f"not served at {cap.high:.3g} req/s, the lowest rate searched"
            return cap
        if cap.low <= 0 and cap.probes and can_show_met is not None and not can_show_met(rate):
            cap.stopped = _not_shown_below(cap, rate)
            return cap
        m = probe(rate)
        cap.probes.append(m)
        cap.knobs = dict(m.knobs)
        if on_probe is not None:
            on_probe(m)
        cap.narrow(rate, m.verdict)
        if cap.rejected:
            cap.stopped = cap.rejected
            return cap
        if cap.resolved:
            cap.stopped = f"bracket within {resolution:.0%}"
            return cap
    cap.stopped = f"{max_probes} probes used"
    return cap


def _not_shown_below(cap: Capacity, rate: float) -> str:
    """Why a search with nothing served stops going down: the lowest probe's verdict, and that ``rate`` is too low
    for a measurement's cap to hold the requests that could show the share."""
    lowest = min(cap.probes, key=lambda m: m.rate)
    f = lowest.figures
    seen = (f"attainment {f.attainment.format('%', 100, 3)} of {f.requests} requests" if f is not None
            else lowest.reason or "failed")
    return (f"{lowest.verdict} at {lowest.rate:.3g} req/s ({seen}); at {rate:.3g} req/s the cap holds too few "
            f"requests to show {TARGET_SHARE:.0%}")


def knob_distance(a: dict[str, Any], b: dict[str, Any], names: list[str]) -> float:
    """How far two configs are apart: the sum over the numeric knobs of |log2(a/b)| (others: 1 when different)."""
    d = 0.0
    for k in names:
        x, y = a.get(k), b.get(k)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x > 0 and y > 0:
            d += abs(math.log2(float(x) / float(y)))
        elif x != y:
            d += 1.0
    return d


def start_from_known(knobs: dict[str, Any], known: list[tuple[dict[str, Any], float, float]], names: list[str],
                     default: float) -> tuple[float, float]:
    """(first rate, step) of a config's search from the brackets ``(knobs, low, high)`` of configs already measured:
    the nearest one's capacity (or, when it served nothing, its lowest rate not served: this config may serve it)
    with a small step; with nothing known, ``default`` and doubling."""
    usable = [(kn, lo, hi) for kn, lo, hi in known if lo > 0 or math.isfinite(hi)]
    if not usable:
        return default, 2.0
    _, lo, hi = min(usable, key=lambda t: knob_distance(knobs, t[0], names))
    return (lo if lo > 0 else hi), 1.5


@dataclass
class CapacitySearcher:
    """Capacity searches on one backend that learn from each other: every search starts from the nearest config
    already searched (``known``: knobs, low, high), or from ``start_rate``."""

    backend: TrialBackend
    spec: MeasurementSpec
    names: list[str]
    resolution: float = 0.15
    max_probes: int = 6
    start_rate: float = 1.0
    known: list[tuple[dict[str, Any], float, float]] = field(default_factory=list)
    on_probe: Callable[[Measurement], None] | None = None
    deadline: float | None = None  # a time.monotonic() after which a search starts no further probe

    def search(self, knobs: dict[str, Any], out_dir: Path, draw: int = 0, start: float | None = None,
               step: float | None = None, max_probes: int | None = None,
               resolution: float | None = None) -> Capacity:
        first, first_step = start_from_known(knobs, self.known, self.names, self.start_rate)
        probes: list[int] = []

        def probe(rate: float) -> Measurement:
            # each probe on a draw of its own (draw, draw + 1, ...): a bracket that ends between two draws' verdicts
            # is less one draw's luck than one whose every probe shares the same arrivals
            probes.append(1)
            i = len(probes) - 1
            return measure(self.backend, knobs, rate, Path(out_dir) / f"probe-{i}", draw + i, self.spec)

        # never start where a measurement could not show the share met (a start from a neighbour that served nothing)
        first = max(start if start is not None else first, self.spec.lowest_rate_to_show())
        cap = search_capacity(probe, knobs, first, resolution or self.resolution,
                              max_probes or self.max_probes, step or first_step, self.on_probe,
                              self.spec.can_show_met, self.time_up)
        cap.draw = draw
        if not cap.rejected:
            self.known.append((cap.knobs, cap.low, cap.high))
        return cap


    def time_up(self) -> str | None:
        if self.deadline is None or time.monotonic() < self.deadline:
            return None
        return "the searches' time is up (the rest is the verdict's)"


def capacity_searcher(runner: TrialBackend, policy: Policy) -> CapacitySearcher:  # a TrialRunner or SimTrialRunner
    """The policy's rate search on ``runner`` (see tuner/measure/capacity.py), its measurements sized by the policy."""
    return CapacitySearcher(runner, measurement_spec(policy), [k.name for k in policy.search_space],
                            policy.capacity.resolution, policy.capacity.max_probes, policy.capacity.start_rate)


def measurement_spec(policy: Policy) -> MeasurementSpec:
    m = policy.measurement
    return MeasurementSpec(level=m.level, min_gaps=m.min_gaps,
                           max_segments=max(1, math.ceil(m.cap / policy.trial_duration - 1e-9)),
                           window_s=policy.trial_duration)
