"""Capacity: the highest offered rate at which a config serves >= 90 % of its requests within the SLO, found by a
rate search that brackets it and bisects the bracket to a stated resolution.

Two brackets come out of a search, and they are not the same thing:

- the **searched** bracket steers the search and ranks configs: ``low`` the highest rate whose attainment read at
  least 90 % (its point estimate), ``high`` the lowest rate above it that read less. It says where the knee
  probably is; it claims nothing.
- the **shown** bracket is what the data show at a stated level (:class:`Shown`): ``low`` the highest rate shown
  served (attainment "met"), ``high`` the lowest rate shown missed; an undecided probe bounds nothing, so either end
  may stay open. Each probe is judged at the search's level spread over its probes (Bonferroni over
  ``max_probes``; within a probe the confidence sequence holds at every look), so both ends hold together at the
  stated level. Contradictory probes (a rate shown missed below one shown served) widen the bracket to cover both
  and are reported; no rate is invented between them.

The search starts where what is known puts it (a neighbouring config's capacity, a simulator's prediction, the same
config's earlier bracket), grows or shrinks by ``step`` until both sides are found, then bisects geometrically
until ``high / low <= 1 + resolution`` or the probes run out. Probe i of a search is on arrival draw base + i.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from policies import Policy
from tuner.measure.measurement import TARGET_SHARE, Measurement, MeasurementSpec, measure
from tuner.measure.statistics import DEFAULT_LEVEL, bonferroni_level
from tuner.trials.trial_backend import TrialBackend

MIN_RATE = 0.02  # req/s: a config that does not serve this is infeasible at any rate


@dataclass(frozen=True)
class Shown:
    """What a set of judged rates shows at ``level``: ``low`` the highest rate shown served below every rate shown
    missed (0: none), ``high`` the lowest rate shown missed above every rate shown served (inf: none);
    ``contradictions`` the pairs (served, missed) with the missed rate below the served one."""

    low: float
    high: float
    level: float
    contradictions: tuple[tuple[float, float], ...] = ()

    @classmethod
    def of(cls, judged: list[tuple[float, str]], level: float) -> Shown:
        met = sorted(r for r, v in judged if v == "met")
        missed = sorted(r for r, v in judged if v == "missed")
        low = max((r for r in met if all(r < m for m in missed)), default=0.0)
        high = min((r for r in missed if all(r > s for s in met)), default=math.inf)
        return cls(low, high, level, tuple((s, m) for s in met for m in missed if m <= s))

    def as_list(self) -> list[float | None]:
        return [self.low, self.high if math.isfinite(self.high) else None]

    def format(self) -> str:
        """``shown at 95%: served 4.2 req/s, missed 8 req/s`` (an open end says so: ``served no rate``)."""
        served = f"{self.low:.3g} req/s" if self.low > 0 else "no rate"
        missed = f"{self.high:.3g} req/s" if math.isfinite(self.high) else "no rate"
        text = f"shown at {self.level * 100:.4g}%: served {served}, missed {missed}"
        if self.contradictions:
            text += " (contradictory: " + ", ".join(f"served {s:.3g} but missed {m:.3g}"
                                                     for s, m in self.contradictions) + ")"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {"bracket": self.as_list(), "level": self.level, "contradictions": [list(c) for c in
                                                                                   self.contradictions]}


@dataclass(frozen=True)
class Ratio:
    """The ratio of two capacities from shown bounds only: None where an end was not shown."""

    low: float | None
    high: float | None

    @classmethod
    def of(cls, mine: Shown, theirs: Shown) -> Ratio:
        """Capacity ratio mine / theirs: shown served over shown missed, shown missed over shown served."""
        low = mine.low / theirs.high if mine.low > 0 and math.isfinite(theirs.high) else None
        high = mine.high / theirs.low if theirs.low > 0 and math.isfinite(mine.high) else None
        return cls(low, high)

    def format(self) -> str:
        if self.low is None and self.high is None:
            return "no multiple shown"
        if self.high is None:
            return f">= {self.low:.3g}x" if self.low and self.low > 1 + 1e-9 else "> 1x"
        if self.low is None:
            return f"<= {self.high:.3g}x"
        return f"{self.low:.3g}-{self.high:.3g}x"

    def as_dict(self) -> dict[str, float | None]:
        return {"low": self.low, "high": self.high}


@dataclass
class Capacity:
    knobs: dict[str, Any]
    probes: list[Measurement] = field(default_factory=list)
    resolution: float = 0.15
    level: float = DEFAULT_LEVEL  # the shown bracket's level (its probes judged at a Bonferroni share of it)
    stopped: str = ""  # why the search ended
    # where the search began: probe i ran on arrival draw ``draw + i``; its first rate and step (a twin of the search,
    # in the simulator, starts there to see the same draws at the same rates while its verdicts agree)
    draw: int = 0
    start: float = 0.0
    step: float = 2.0

    def steer(self) -> list[tuple[float, str]]:
        """Each probe's reading for steering: "up" where its attainment read >= the target share (or was shown met),
        "down" where it read less (or failed for the config); a void probe reads nothing."""
        out = []
        for m in self.probes:
            if m.void is not None:
                continue
            if m.reason is not None or m.figures is None:
                out.append((m.rate, "down"))
            elif m.verdict == "met" or (m.verdict != "missed" and m.figures.attainment.value >= TARGET_SHARE):
                out.append((m.rate, "up"))
            else:
                out.append((m.rate, "down"))
        return out

    @property
    def searched(self) -> tuple[float, float]:
        """The searched bracket (low, high): where the point estimates put the knee (contradictions widen it)."""
        s = Shown.of([(r, "met" if d == "up" else "missed") for r, d in self.steer()], self.level)
        return s.low, s.high

    @property
    def low(self) -> float:
        return self.searched[0]

    @property
    def high(self) -> float:
        return self.searched[1]

    @property
    def value(self) -> float:
        """The searched capacity: it ranks configs and picks the verdict's rates; the shown bracket is the claim."""
        return self.low

    @property
    def bracket(self) -> list[float | None]:
        """The searched [low, high]; high None where no rate probed read below the target."""
        low, high = self.searched
        return [low, high if math.isfinite(high) else None]

    @property
    def shown(self) -> Shown:
        return Shown.of([(m.rate, m.verdict) for m in self.probes], self.level)

    @property
    def resolved(self) -> bool:
        low, high = self.searched
        return low > 0 and math.isfinite(high) and high / low <= 1 + self.resolution + 1e-9

    @property
    def feasible(self) -> bool:
        return self.low > 0

    @property
    def at_capacity(self) -> Measurement | None:
        """The measurement at the searched low (the highest rate that read served), else the last one."""
        here = [m for m in self.probes if m.rate == self.low and m.void is None]
        return here[-1] if here else (self.probes[-1] if self.probes else None)

    @property
    def output_tokens_per_s(self) -> float | None:
        m = self.at_capacity
        return m.output_tokens_per_s if m is not None and m.rate == self.low else None

    @property
    def bound(self) -> str:
        """What ends the capacity: ``ttft`` or ``tbt`` when at the lowest rate read below the target only that
        target's pooled p99 missed; empty when both did, neither did (attainment alone), or nothing read below."""
        above = [m for m in self.probes if m.rate >= self.high and m.figures is not None]
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
        """``searched 3.1 req/s (3.1-3.4, 6 probes), shown at 95%: served no rate, missed 4 req/s, 310 output tok/s``."""
        if not self.probes:
            return "capacity not measured"
        if not self.feasible:
            return (f"no rate read served down to {self.high:.3g} req/s ({self.stopped}); {self.shown.format()}")
        high = f"{self.high:.3g}" if math.isfinite(self.high) else "?"
        toks = self.output_tokens_per_s
        return (f"searched {self.low:.3g} req/s ({self.low:.3g}-{high}, {len(self.probes)} probes), "
                f"{self.shown.format()}" + (f", {toks:.0f} output tok/s" if toks is not None else ""))

    def as_dict(self) -> dict[str, Any]:
        at = self.at_capacity
        return {"req_per_s": self.low, "bracket": self.bracket, "shown": self.shown.as_dict(),
                "describe": self.describe(), "at_capacity": at.describe() if at is not None else None,
                "resolved": self.resolved, "output_tokens_per_s": self.output_tokens_per_s, "stopped": self.stopped,
                "bound": self.bound, "draw": self.draw, "start": self.start, "step": self.step,
                "probes": [probe_record(m) for m in self.probes]}


def probe_record(m: Measurement) -> dict[str, Any]:
    """A probe as the study keeps it: its rate, verdict, counts, blocks and line."""
    f = m.figures
    return {"rate": m.rate, "verdict": m.verdict, "requests": f.requests if f else 0,
            "attaining": f.attaining if f else 0, "attainment": f.attainment.value if f and f.requests else None,
            "blocks": [list(b) for b in f.blocks] if f else [], "reason": m.reason, "void": m.void,
            "output_tokens_per_s": m.output_tokens_per_s, "describe": m.describe(),
            "reached": f.reached.as_dict() if f is not None and f.reached is not None else None}


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
                    time_up: Callable[[], str | None] | None = None, level: float = DEFAULT_LEVEL) -> Capacity:
    """Bracket and bisect the capacity of ``knobs``, steered by the searched bracket; ``probe(rate)`` measures it
    at a rate. ``time_up()``: why no further probe may start (None: it may); the first probe always runs.
    ``level``: the shown bracket's (the probes are judged at its Bonferroni share)."""
    cap = Capacity(dict(knobs), resolution=resolution, level=level, start=start, step=step)
    while len(cap.probes) < max_probes:
        late = time_up() if time_up is not None and cap.probes else None
        if late:
            cap.stopped = late
            return cap
        rate = next_rate(cap.low, cap.high, start, step)
        if rate < MIN_RATE:
            cap.stopped = f"read below {TARGET_SHARE:.0%} at {cap.high:.3g} req/s, the lowest rate searched"
            return cap
        m = probe(rate)
        cap.probes.append(m)
        cap.knobs = dict(m.knobs)
        if on_probe is not None:
            on_probe(m)
        if cap.rejected:
            cap.stopped = cap.rejected
            return cap
        if cap.resolved:
            cap.stopped = f"searched bracket within {resolution:.0%}"
            return cap
    cap.stopped = f"{max_probes} probes used"
    return cap


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
    draw: int = 0  # every search's probe i runs on arrival draw ``draw + i`` (the same draws for every config)
    level: float = DEFAULT_LEVEL  # the shown brackets' level (``spec`` judges each probe at its Bonferroni share)

    def search(self, knobs: dict[str, Any], out_dir: Path, draw: int | None = None, start: float | None = None,
               step: float | None = None, max_probes: int | None = None,
               resolution: float | None = None) -> Capacity:
        first, first_step = start_from_known(knobs, self.known, self.names, self.start_rate)
        draw = self.draw if draw is None else draw
        probes: list[int] = []

        def probe(rate: float) -> Measurement:
            # each probe on a draw of its own (draw, draw + 1, ...): a bracket that ends between two draws' verdicts
            # is less one draw's luck than one whose every probe shares the same arrivals
            probes.append(1)
            i = len(probes) - 1
            return measure(self.backend, knobs, rate, Path(out_dir) / f"probe-{i}", draw + i, self.spec)

        cap = search_capacity(probe, knobs, start if start is not None else first, resolution or self.resolution,
                              max_probes or self.max_probes, step or first_step, self.on_probe, self.time_up,
                              self.level)
        cap.draw = draw
        if not cap.rejected:
            self.known.append((cap.knobs, cap.low, cap.high))
        return cap

    def time_up(self) -> str | None:
        if self.deadline is None or time.monotonic() < self.deadline:
            return None
        return "the searches' time is up (the rest is the verdict's)"


def capacity_searcher(runner: TrialBackend, policy: Policy) -> CapacitySearcher:  # a TrialRunner or SimTrialRunner
    """The policy's rate search on ``runner`` (see tuner/measure/capacity.py): each probe judged at the level's
    Bonferroni share over the search's probes, so that a shown bracket holds at the policy's level."""
    spec = replace(measurement_spec(policy), level=bonferroni_level(policy.measurement.level,
                                                                      policy.capacity.max_probes))
    return CapacitySearcher(runner, spec, [k.name for k in policy.search_space], policy.capacity.resolution,
                            policy.capacity.max_probes, policy.capacity.start_rate, level=policy.measurement.level)


def measurement_spec(policy: Policy) -> MeasurementSpec:
    """A measurement sized by the policy, at the policy's level."""
    m = policy.measurement
    return MeasurementSpec(level=m.level, min_gaps=m.min_gaps,
                           max_segments=max(1, math.ceil(m.cap / policy.trial_duration - 1e-9)),
                           window_s=policy.trial_duration, block_s=m.block)
