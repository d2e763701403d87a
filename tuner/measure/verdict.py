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

**Where it measures.** Each round, on a fresh arrival draw shared by every config: the candidate at its planned rate
(:func:`first_rate`, then :func:`plan_next`: two rates at most), the default at the same rate on the same arrivals
(paired), and the default at its own ceiling (:func:`ceiling_rate`), where a miss gives the ratio a multiple.

**What it reports.** The headline is paired attainment at the candidate's rate: the two configs on the same arrivals,
block by block, the confidence sequence of their difference (:meth:`VerdictResult.paired_difference`). Beside it
each config's shown bracket, and the capacities' ratio only from shown bounds (:class:`Ratio`): its low end the
candidate's shown-served rate over the default's shown-missed rate, its high end the candidate's shown-missed rate
over the default's shown-served rate; an end that was not shown stays open.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from tuner.measure.capacity import Ratio, Shown
from tuner.measure.dependence import Block, attainment_interval, paired_difference_interval
from tuner.measure.measurement import TARGET_SHARE, MeasurementSpec, reachable
from tuner.measure.statistics import DEFAULT_LEVEL, Interval, Verdict, lower_verdict

DEFAULT = "default"
Outcome = Literal["better", "not better", "undecided"]
RATES_PER_CANDIDATE = 2  # a candidate is judged at its first rate and at most one step below it


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
            return "missed"
        return lower_verdict(self.attainment(share), share) if self.requests else "undecided"

    def within_reach(self, wanted: Verdict, more_blocks: int, share: float = TARGET_SHARE) -> bool:
        """Whether ``more_blocks`` further blocks, at a moderately optimistic reading of those so far, would bring
        the pool to ``wanted`` (the measurement's futility rule)."""
        spec = MeasurementSpec(level=self.level, target_share=share)
        return reachable(wanted, self.blocks(), more_blocks, spec)

    def as_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "requests": self.requests, "attaining": self.attaining, "level": self.level,
                "attainment": self.attainment().as_dict(), "verdict": self.verdict(),
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
        pool = self.pools.setdefault(rate_key(sample.rate), Pool(rate_key(sample.rate), level))
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
        """No winner: the config with the highest rate shown served on the verdict's draws (the default on ties)."""
        return max([self.default] + self.candidates, key=lambda c: (c.shown().low, c is self.default))

    def as_dict(self) -> dict[str, Any]:
        def entry(c: Contender) -> dict[str, Any]:
            d = c.as_dict()
            if not c.is_default:
                d["ratio_to_default"] = self.ratio(c).as_dict()
                d["outcome"] = self.outcome(c)
                rate = c.next_rate if c.next_rate is not None else c.shown().low
                diffs = {f"{p.rate:.6g}": iv.as_dict() for p in c.pools.values()
                         if (iv := self.paired_difference(c, p.rate)) is not None}
                d["paired_difference"] = diffs
                d["headline_rate"] = rate
            return d

        return {"level": self.level, "pool_level": {"candidates": self.look(self.candidates[0]) if self.candidates
                                                    else None, "default": self.look(self.default)},
                "max_rounds": self.max_rounds, "stopped": self.stopped,
                "default": entry(self.default), "candidates": [entry(c) for c in self.candidates],
                "winner": self.winner.name if self.winner else None, "safest": self.safest.name}


# measure(contender, rate, draw) -> the sample of one measurement (sized by the verdict)
MeasureAt = Callable[[Contender, float, int], Sample]


def plan_next(c: Contender, step: float, floor: float, more_blocks: int, default_missed: float = math.inf,
              default_high: float = math.inf) -> None:
    """Where candidate ``c`` is measured next round, from its pool at the rate just measured; ``more_blocks``: the
    blocks another round adds there. It stays while another round may show it served; else it steps down as its
    first rate was placed below its claim (:func:`first_rate` against the default's searched ``default_high``: a
    candidate near its knee attains a few points more a step lower, too few to be shown, while the default still
    misses further down), or straight to ``default_missed`` where the default is already shown missed lower: the
    candidate need only serve that rate to be better, and serves it most surely (a sustained window's knee can lie
    far below a search's). None once it is shown served, or when a step would go below ``floor`` or past its
    :data:`RATES_PER_CANDIDATE` rates."""
    rate = c.next_rate
    pool = c.pool(rate) if rate is not None else None
    if rate is None or pool is None:
        return
    v = pool.verdict()
    if v == "met":
        c.next_rate = None
    elif v == "missed" or not pool.within_reach("met", more_blocks):
        down = first_rate(rate, default_high, step)
        if default_missed < down * (1 - 1e-9):
            down = default_missed
        fits = down >= floor * (1 - 1e-9) and len(c.pools) < RATES_PER_CANDIDATE
        c.next_rate = down if fits else None


def default_rates(result: VerdictResult, step: float) -> list[float]:
    """Where the default config is measured this round: beside each undecided candidate at its rate (paired on the
    same arrivals), and at its own searched ceiling (a step above the lowest rate its search read below the target
    share, when that is below the candidates' rates); at each until its pool there is decided."""
    d = result.default
    undecided = [c for c in result.candidates if result.outcome(c) == "undecided" and c.next_rate is not None]
    rates = [c.next_rate for c in undecided if c.next_rate is not None]
    own = ceiling_rate(d, step)
    below = rates + ([result.winner.shown().low] if result.winner is not None else [])
    if below and own is not None and own < min(below) * (1 - 1e-9):
        rates.append(own)
    return sorted(r for r in set(rate_key(r) for r in rates)
                  if (pool := d.pool(r)) is None or pool.verdict() == "undecided")


def ceiling_open(result: VerdictResult, step: float) -> bool:
    """Whether the default's own ceiling, below the winner's shown-served rate, is still undecided (a miss there
    would give the ratio a multiple)."""
    own, w = ceiling_rate(result.default, step), result.winner
    if own is None or w is None or own >= w.shown().low * (1 - 1e-9):
        return False
    pool = result.default.pool(own)
    return pool is None or pool.verdict() == "undecided"


def ceiling_rate(default: Contender, step: float) -> float | None:
    """The default's own rate in the verdict: a step above the lowest rate its search read below the target share
    (None: its search read every rate served)."""
    return rate_key(default.search_high * step) if math.isfinite(default.search_high) else None


def first_rate(claim: float, default_high: float, step: float) -> float:
    """Where a candidate is first measured: one step below its searched capacity (the best of the searched configs
    on one draw is likely to have been lucky there), or lower, down to two steps, where the geometric middle
    between it and the default's searched ceiling lies lower: there it attains more surely while the default misses
    (a 1.3x difference is shown at the middle, not at the candidate's edge)."""
    middle = math.sqrt(claim * default_high) if math.isfinite(default_high) else 0.0
    return min(claim / step, max(claim / step ** 2, middle))


def paired_verdict(default: Contender, candidates: list[Contender], measure_at: MeasureAt, max_rounds: int = 4,
                   budget_s: float = 300.0, level: float = DEFAULT_LEVEL, step: float = 1.15, floor: float = 0.0,
                   first_draw: int = 100, on_round: Callable[[int, VerdictResult], None] | None = None,
                   clock: Callable[[], float] = time.monotonic,
                   cost: Callable[[list[tuple[Contender, float]]], float] | None = None) -> VerdictResult:
    """Rounds on fresh draws (one per round, shared by every config in it; the order alternating) until every
    candidate's outcome is decided (or one is better and no undecided one could beat it), nothing is left to
    measure, the rounds run out, or the next round would not fit in what is left of ``budget_s`` (``cost`` of its
    measurements, else the slowest round so far; the first round always runs). ``floor``: the lowest rate a
    candidate steps down to. Rounds cost no error rate: at each rate they continue one confidence sequence."""
    result = VerdictResult(default, candidates, level, max_rounds)
    started, slowest = clock(), 0.0
    for r in range(max_rounds):
        plan = [(default, rate) for rate in default_rates(result, step)]
        plan += [(c, rate) for c in candidates
                 if (rate := c.next_rate) is not None and result.outcome(c) == "undecided"]
        if not plan:
            result.stopped = f"nothing left to measure could decide, after {r} rounds"
            return result
        if r >= 1 and clock() - started + (cost(plan) if cost is not None else slowest) > budget_s:
            result.stopped = f"time budget ({budget_s:.0f}s) used after {r} rounds"
            return result
        t0 = clock()
        measured: set[str] = set()
        for c, rate in (plan if r % 2 == 0 else plan[::-1]):
            sample = measure_at(c, rate, first_draw + r)
            c.add(sample, result.look(c))
            if c.name not in measured:
                c.rounds += 1
                measured.add(c.name)
        for c in candidates:
            pool = c.pool(c.next_rate) if c.next_rate is not None else None
            last = pool.samples[-1] if pool and pool.samples else None
            plan_next(c, step, floor, max(1, len(last.blocks) if last else 1), default.shown().high,
                      default.search_high)
        slowest = max(slowest, clock() - t0)
        if on_round is not None:
            on_round(r + 1, result)
        w = result.winner
        if w is not None and not any(result.outcome(c) == "undecided" and c.claim > w.shown().low
                                     for c in candidates):
            # the winner is decided; the default's own ceiling may still give the ratio a multiple
            if not ceiling_open(result, step) or r + 1 >= max_rounds or (
                    clock() - started + (cost([(default, ceiling_rate(default, step) or 0.0)]) if cost is not None
                                         else slowest) > budget_s):
                result.stopped = f"{w.name} shown better after {r + 1} rounds"
                return result
    decided = all(result.outcome(c) != "undecided" for c in candidates)
    rounds = max(c.rounds for c in [default] + candidates)
    result.stopped = f"decided after {rounds} rounds" if decided else f"{max_rounds} rounds"
    return result
