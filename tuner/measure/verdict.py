"""The verdict: does the best candidate serve more traffic than the default config, beyond the noise?

It deals in claims, each a measurement at a fixed rate judged by the confidence sequence of its blocks
(tuner/measure/dependence.py):

- "the candidate serves r": its attainment at r shown met on fresh arrival draws;
- "the default does not serve r'": its attainment at r' shown missed.

The candidate is **better** when it is shown to serve a rate at or above one where the default is shown to miss: its
capacity is then above the default's (attainment falls as the offered rate grows). It is **not better** when the
default is shown to serve a rate at or above one where the candidate is shown to miss. Nothing else is a route to
either: a candidate that attains more where the default is undecided is reported as such, not as serving more.

**One error budget.** A wrong "better" needs a wrong "serves" of the candidate or a wrong "does not serve" of the
default; each side gets half of 1 - level, spread (Bonferroni) over every rate it may be judged at in the verdict
(:func:`pool_level`). At one rate, each round's measurement continues the same confidence sequence, so looking after
every round costs nothing. The searches' probes are not pooled in (they ran in windows from an idle engine, the
verdict in sustained ones, and the candidates were picked for how their searches went).

**Where it measures** (tuner/measure/verdict_rounds.py). Each round, on a fresh arrival draw shared by every config:
the candidate at its planned rate (its first rate, then once lower at most: two rates), the default at the same
rate on the same arrivals (paired), and the default at its own ceiling, where a miss gives the ratio a multiple.

**The winner climbs.** A candidate shown better was often shown served far below its knee (at the rate where the
default misses, where a serve decides). While rounds are left it climbs toward the lowest rate above that it was not
shown to serve: each climb a new pool at the same level, started only once the rate below it was shown served. Its
"serves" cost no further error rate: the climbs go up, so the first wrong "serves" among them and the pool they
climbed from is at the first of their rates that the candidate does not serve (below it every claim is true, and no
climb above it starts unless it claimed), one pool judged at that pool's share. A climb's "missed" is not covered by
that argument and is not claimed (:attr:`Pool.served_only`): it ends the climbing.

**What it reports.** The headline is paired attainment at the candidate's rate: the two configs on the same arrivals,
block by block, the confidence sequence of their difference (:meth:`VerdictResult.paired_difference`). Beside it
each config's shown bracket, and the capacities' ratio only from shown bounds (:class:`Ratio`): its low end the
candidate's shown-served rate over the default's shown-missed rate, its high end the candidate's shown-missed rate
over the default's shown-served rate; an end that was not shown stays open.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from tuner.measure.capacity import Ratio, Shown
from tuner.measure.dependence import Block, attainment_interval, paired_difference_interval
from tuner.measure.measurement import TARGET_SHARE, MeasurementSpec, reachable
from tuner.measure.statistics import DEFAULT_LEVEL, Interval, Verdict, lower_verdict

DEFAULT = "default"
Outcome = Literal["better", "not better", "undecided"]
RATES_PER_CANDIDATE = 2  # a candidate is judged at its first rate and at most one rate below it (a winner's climbs
# claim on the share of the pool they climb from: tuner/measure/verdict_rounds.py)


@dataclass(frozen=True)
class Sample:
    """One measurement of a config at a rate on one arrival draw: its blocks of (attaining, requests)."""

    rate: float
    draw: int
    blocks: tuple[Block, ...] = ()
    failed: str | None = None  # a rejected config, a crashed engine: the config does not serve this rate
    void: str | None = None  # the measuring machinery failed: no evidence either way
    output_tokens_per_s: float | None = None
    summary: str = ""  # the measurement's own line (its figures with intervals)

    @property
    def requests(self) -> int:
        return sum(n for _, n in self.blocks)

    @property
    def attaining(self) -> int:
        return sum(a for a, _ in self.blocks)

    def as_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "draw": self.draw, "attaining": self.attaining, "requests": self.requests,
                "blocks": [list(b) for b in self.blocks], "failed": self.failed, "void": self.void,
                "output_tokens_per_s": self.output_tokens_per_s, "summary": self.summary}


@dataclass
class Pool:
    """Every sample of a config at one rate, their blocks in the order measured: one confidence sequence."""

    rate: float
    level: float = DEFAULT_LEVEL
    samples: list[Sample] = field(default_factory=list)
    served_only: bool = False  # a winner's climb: only its "served" is a claim (its "missed" reads undecided)

    def blocks(self) -> tuple[Block, ...]:
        return tuple(b for s in self.samples if s.void is None for b in s.blocks)

    @property
    def requests(self) -> int:
        return sum(n for _, n in self.blocks())

    @property
    def attaining(self) -> int:
        return sum(a for a, _ in self.blocks())

    @property
    def failed(self) -> str | None:
        return next((s.failed for s in self.samples if s.failed), None)

    def attainment(self, share: float = TARGET_SHARE) -> Interval:
        return attainment_interval(self.blocks(), self.level, share)

    def verdict(self, share: float = TARGET_SHARE) -> Verdict:
        if self.failed:
            v: Verdict = "missed"
        else:
            v = lower_verdict(self.attainment(share), share) if self.requests else "undecided"
        return "undecided" if self.served_only and v == "missed" else v

    def within_reach(self, wanted: Verdict, more_blocks: int, share: float = TARGET_SHARE) -> bool:
        """Whether ``more_blocks`` further blocks, at a moderately optimistic reading of those so far, would bring
        the pool to ``wanted`` (the measurement's futility rule)."""
        spec = MeasurementSpec(level=self.level, target_share=share)
        return reachable(wanted, self.blocks(), more_blocks, spec)

    def as_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "requests": self.requests, "attaining": self.attaining, "level": self.level,
                "attainment": self.attainment().as_dict(), "verdict": self.verdict(), "climb": self.served_only,
                "samples": [s.as_dict() for s in self.samples]}


def rate_key(rate: float) -> float:
    """Pools are keyed by rate; rates computed by different paths (a bracket's end, a step down) agree to 1e-9."""
    return round(rate, 9) if math.isfinite(rate) else rate


@dataclass
class Contender:
    """A config in the verdict: its pools by rate, and the rate it is measured at next (None: nothing to show)."""

    name: str  # "default" or "candidate N (trial #k)"
    knobs: dict[str, Any]
    claim: float  # the capacity its search claimed (a candidate) / its search's ceiling (the default)
    search_high: float = math.inf  # the lowest rate its search read below the target share
    pools: dict[float, Pool] = field(default_factory=dict)
    next_rate: float | None = None
    rounds: int = 0  # rounds it was measured in
    climbs: set[float] = field(default_factory=set)  # the rates it climbed to once shown better (Pool.served_only)

    def __post_init__(self) -> None:
        if self.next_rate is None and not self.is_default:
            self.next_rate = self.claim

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT

    def pool(self, rate: float) -> Pool | None:
        return self.pools.get(rate_key(rate))

    def add(self, sample: Sample, level: float) -> Pool:
        """Pool ``sample`` with the others at its rate (every pool judged at ``level``, fixed before the verdict)."""
        key = rate_key(sample.rate)
        pool = self.pools.setdefault(key, Pool(key, level, served_only=key in self.climbs))
        pool.samples.append(sample)
        return pool

    def shown(self) -> Shown:
        """What the verdict's pools show: the highest rate shown served, the lowest shown missed (open ends)."""
        level = max((p.level for p in self.pools.values()), default=DEFAULT_LEVEL)
        return Shown.of([(p.rate, p.verdict()) for p in self.pools.values()], level)

    def tokens_at(self, rate: float) -> float | None:
        """The mean output tokens/s of the samples at ``rate`` (None: none measured there)."""
        pool = self.pool(rate)
        values = [s.output_tokens_per_s for s in pool.samples if s.output_tokens_per_s] if pool else []
        return sum(values) / len(values) if values else None

    def as_dict(self) -> dict[str, Any]:
        shown = self.shown()
        return {"knobs": self.knobs, "searched_req_per_s": self.claim, "shown": shown.as_dict(),
                "output_tokens_per_s": self.tokens_at(shown.low) if shown.low > 0 else None, "rounds": self.rounds,
                "pools": [p.as_dict() for p in sorted(self.pools.values(), key=lambda p: p.rate)]}


def pool_level(level: float, rates: int) -> float:
    """The two-sided level of a pool's confidence sequence when one side of ``level``'s error rate (half of it) is
    spread over ``rates`` rates: each pool's one-sided error (1 - level) / 2 / rates."""
    return 1.0 - (1.0 - level) / max(1, rates)


def pool_levels(level: float, candidates: int) -> tuple[float, float]:
    """(a candidate's pools, the default's pools): each candidate is judged at :data:`RATES_PER_CANDIDATE` rates at
    most, the default beside each of them and at its own ceiling."""
    rates = RATES_PER_CANDIDATE * max(1, candidates)
    return pool_level(level, rates), pool_level(level, rates + 1)


@dataclass
class VerdictResult:
    default: Contender
    candidates: list[Contender]
    level: float  # the overall level of "better" / "not better"
    max_rounds: int = 4
    stopped: str = ""

    def look(self, c: Contender) -> float:
        """The level ``c``'s pools are judged at: its side's half of the error rate over the rates it may be judged
        at (:func:`pool_levels`)."""
        return pool_levels(self.level, len(self.candidates))[1 if c.is_default else 0]

    def outcome(self, c: Contender) -> Outcome:
        mine, theirs = c.shown(), self.default.shown()
        if mine.low > 0 and rate_key(mine.low) >= rate_key(theirs.high):
            return "better"
        if theirs.low > 0 and rate_key(theirs.low) >= rate_key(mine.high):
            return "not better"
        return "undecided"

    def paired_difference(self, c: Contender, rate: float) -> Interval | None:
        """The candidate's attainment at ``rate`` minus the default's on the same arrivals: the samples of one
        draw paired block by block (the blocks both measured), the confidence sequence of the differences at the
        verdict's pool level. None without a draw both were measured on at that rate."""
        mine, theirs = c.pool(rate), self.default.pool(rate)
        if mine is None or theirs is None:
            return None
        by_draw = {s.draw: s for s in theirs.samples if s.void is None and not s.failed}
        pairs = [(s, by_draw[s.draw]) for s in mine.samples if s.void is None and not s.failed and s.draw in by_draw]
        if not pairs:
            return None
        a = [b for s, t in pairs for b in s.blocks[:len(t.blocks)]]
        d = [b for s, t in pairs for b in t.blocks[:len(s.blocks)]]
        return paired_difference_interval(a, d, self.look(self.default))

    def ratio(self, c: Contender) -> Ratio:
        """Capacity ratio candidate / default from shown bounds (:class:`Ratio`)."""
        return Ratio.of(c.shown(), self.default.shown())

    def headline_rate(self, c: Contender) -> float:
        """The rate of a candidate's paired headline: the highest it was shown to serve with the default measured
        beside it on the same arrivals (a climb is not paired), else the highest rate with such a pair, else the
        highest it was shown to serve, else the rate it is measured at next, else the highest it was measured at."""
        paired = [(p.verdict() == "met", p.rate) for p in c.pools.values()
                  if self.paired_difference(c, p.rate) is not None]
        shown = c.shown().low
        if paired:
            return max(paired)[1]
        return shown if shown > 0 else (c.next_rate or max((p.rate for p in c.pools.values()), default=0.0))

    @property
    def best(self) -> Contender | None:
        """The candidate with the highest shown-served rate (then the highest searched capacity)."""
        return max(self.candidates, key=lambda c: (c.shown().low, c.claim)) if self.candidates else None

    @property
    def winner(self) -> Contender | None:
        """The best of the candidates shown better than the default, if any."""
        better = [c for c in self.candidates if self.outcome(c) == "better"]
        return max(better, key=lambda c: c.shown().low) if better else None

    @property
    def safest(self) -> Contender:
        """No winner: the config with the highest rate shown served on the verdict's draws (the default on ties); where
        none was shown to serve a rate, the candidate shown to attain more than the default on the same arrivals
        (:meth:`shown_gain`, the largest), else the default. The last is a choice, not a claim: a gain at the rates
        measured does not order capacities (the curves may cross), and the verdict line says which it is."""
        top = max([self.default] + self.candidates, key=lambda c: (c.shown().low, c is self.default))
        if top.shown().low > 0:
            return top
        gains = [(gain, c) for c in self.candidates if (gain := self.shown_gain(c)) is not None]
        return max(gains, key=lambda g: g[0])[1] if gains else self.default

    def shown_gain(self, c: Contender) -> float | None:
        """The largest lower bound of ``c``'s paired differences against the default, where one is above zero and
        none is below (None otherwise)."""
        diffs = [iv for p in c.pools.values() if (iv := self.paired_difference(c, p.rate)) is not None]
        if not diffs or any(iv.high < 0 for iv in diffs):
            return None
        low = max(iv.low for iv in diffs)
        return low if low > 0 else None

    def as_dict(self) -> dict[str, Any]:
        def entry(c: Contender) -> dict[str, Any]:
            d = c.as_dict()
            if not c.is_default:
                d["ratio_to_default"] = self.ratio(c).as_dict()
                d["outcome"] = self.outcome(c)
                diffs = {f"{p.rate:.6g}": iv.as_dict() for p in c.pools.values()
                         if (iv := self.paired_difference(c, p.rate)) is not None}
                d["paired_difference"] = diffs
                d["headline_rate"] = self.headline_rate(c)
            return d

        return {"level": self.level, "pool_level": {"candidates": self.look(self.candidates[0]) if self.candidates
                                                    else None, "default": self.look(self.default)},
                "max_rounds": self.max_rounds, "stopped": self.stopped,
                "default": entry(self.default), "candidates": [entry(c) for c in self.candidates],
                "winner": self.winner.name if self.winner else None, "safest": self.safest.name}
