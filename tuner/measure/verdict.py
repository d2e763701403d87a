"""The paired, repeated verdict: the default config and the best candidates re-measured round by round on fresh
arrival draws, every config of a round on the same draw (common random numbers), the order alternating between
rounds, until the best candidate's capacity ratio to the default has an interval that excludes 1, or the rounds or
the time budget run out.

Each round measures each config's capacity again (a short rate search started at what the search found: a config's
round capacity is the highest rate that round showed it serves). A config's capacity over the rounds is the
geometric mean of its round capacities with a t interval on the log scale; the ratio of two configs is the paired
ratio of their round capacities (tuner.measure.statistics.paired_ratio_interval).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tuner.measure.capacity import MIN_RATE
from tuner.measure.statistics import DEFAULT_LEVEL, Interval, paired_ratio_interval, ratio_verdict

DEFAULT = "default"


@dataclass
class Contender:
    name: str  # "default" or "candidate N"
    knobs: dict[str, Any]
    start: float  # where its round searches start (its capacity from the search)
    rounds: list[float] = field(default_factory=list)  # capacity per round (highest rate shown served; 0: none)
    ceilings: list[float] = field(default_factory=list)  # per round, the lowest rate not shown served (inf: none)
    tokens: list[float] = field(default_factory=list)  # output tokens/s at that capacity per round

    def capacity(self, level: float = DEFAULT_LEVEL) -> Interval:
        """Geometric mean of the round capacities; the interval's low end the t bound of the rounds' capacities,
        its high end that of their ceilings, so each round's bracket counts as well as the spread between rounds
        (with one round the high end is unbounded). When some round showed no rate served, no mean is claimed:
        the value is 0, the range up to the highest ceiling."""
        if self.rounds and min(self.rounds) <= 0:
            return Interval(0.0, 0.0, max(self.ceilings, default=math.inf), level, len(self.rounds))
        lows = geometric_interval(self.rounds, level)
        highs = geometric_interval([c if math.isfinite(c) else math.inf for c in self.ceilings], level)
        high = highs.high if all(math.isfinite(c) for c in self.ceilings) else math.inf
        return Interval(lows.value, lows.low, max(high, lows.value), level, len(self.rounds))

    def upper(self, i: int) -> float:
        """Round i's capacity, or where nothing was shown served there, its ceiling (a bound from above)."""
        return self.rounds[i] if self.rounds[i] > 0 else self.ceilings[i]


def geometric_interval(values: list[float], level: float = DEFAULT_LEVEL) -> Interval:
    positive = [v for v in values if v > 0]
    if not positive:
        return Interval(0.0, 0.0, math.inf, level, len(values))
    # the paired ratio against a constant 1 is the geometric mean with its t interval
    return paired_ratio_interval(positive, [1.0] * len(positive), level)


def look_level(level: float, max_rounds: int) -> float:
    """The level of each look at the ratio: the verdict looks after every round from the second on, so each look
    gets a Bonferroni share of the error rate and stopping at the first exclusion keeps the overall level."""
    return 1.0 - (1.0 - level) / max(1, max_rounds - 1)


@dataclass
class VerdictResult:
    default: Contender
    candidates: list[Contender]
    level: float  # the overall level; ratios are shown at the per-look level that decided them
    stopped: str
    max_rounds: int = 4

    @property
    def ratio_level(self) -> float:
        return look_level(self.level, self.max_rounds)

    def ratio(self, c: Contender) -> Interval:
        """Paired ratio of the rounds' capacities, each round known only within its bracket: the low end is the
        paired t bound of (candidate's capacity / default's ceiling), the high end that of (candidate's ceiling /
        default's capacity), the value the geometric mean of the rounds' capacity ratios. So a ratio is "better"
        only when even the brackets' unfavourable ends, and the spread between rounds, leave it above 1. A round
        where the default showed no rate served uses its ceiling as its capacity (errs low, never in the
        candidate's favour); one where the candidate showed none counts as the lowest rate any search tries."""
        n = min(len(c.rounds), len(self.default.rounds))
        d = self.default
        ours = [v if v > 0 else MIN_RATE for v in c.rounds[:n]]
        mid = paired_ratio_interval(ours, [d.upper(i) for i in range(n)], self.ratio_level)
        low = paired_ratio_interval(ours, [d.ceilings[i] if math.isfinite(d.ceilings[i]) else d.upper(i)
                                           for i in range(n)], self.ratio_level)
        tops = [x if math.isfinite(x) else math.nan for x in c.ceilings[:n]]
        if any(math.isnan(x) for x in tops) or any(d.rounds[i] <= 0 for i in range(n)):
            high = math.inf
        else:
            high = paired_ratio_interval(tops, d.rounds[:n], self.ratio_level).high
        return Interval(mid.value, min(low.low, mid.value), max(high, mid.value), self.ratio_level, mid.n)

    @property
    def best(self) -> Contender | None:
        """The candidate with the highest ratio's lower bound (then point), if any was measured."""
        measured = [c for c in self.candidates if c.rounds]
        if not measured:
            return None
        return max(measured, key=lambda c: (self.ratio(c).low, self.ratio(c).value))

    @property
    def winner(self) -> Contender | None:
        """The best candidate when it beats the default beyond the noise, else None."""
        b = self.best
        return b if b is not None and ratio_verdict(self.ratio(b)) == "better" else None

    @property
    def safest(self) -> Contender:
        """No winner: the config whose capacity's lower bound is highest (the default on ties)."""
        everyone = [self.default] + [c for c in self.candidates if c.rounds]
        return max(everyone, key=lambda c: (finite(c.capacity(self.level).low), c is self.default))

    def as_dict(self) -> dict[str, Any]:
        def entry(c: Contender) -> dict[str, Any]:
            d: dict[str, Any] = {"knobs": c.knobs, "rounds_req_per_s": c.rounds,
                                 "rounds_ceiling_req_per_s": [x if math.isfinite(x) else None for x in c.ceilings],
                                 "rounds_tokens_per_s": c.tokens,
                                 "capacity_req_per_s": c.capacity(self.level).as_dict()}
            if c is not self.default:
                d["ratio_to_default"] = self.ratio(c).as_dict()
                d["ratio_verdict"] = ratio_verdict(self.ratio(c))
            return d

        return {"level": self.level, "stopped": self.stopped, "default": entry(self.default),
                "candidates": [entry(c) for c in self.candidates],
                "winner": self.winner.name if self.winner else None, "safest": self.safest.name}


def finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


# (capacity req/s: the highest rate shown served, 0 if none; the lowest not shown served; output tokens/s)
RoundCapacity = Callable[[Contender, int], tuple[float, float, float | None]]


def paired_verdict(default: Contender, candidates: list[Contender], round_capacity: RoundCapacity,
                   max_rounds: int = 4, budget_s: float = 300.0, level: float = DEFAULT_LEVEL, first_draw: int = 100,
                   on_round: Callable[[int, VerdictResult], None] | None = None,
                   clock: Callable[[], float] = time.monotonic) -> VerdictResult:
    """Rounds of ``round_capacity(contender, draw) -> (capacity, ceiling, output tokens/s)`` for the default and every
    candidate, alternating the order, until the best ratio's interval excludes 1 (after at least two rounds), the
    rounds run out, or a round would not fit in what is left of ``budget_s`` (judged by the slowest round so far)."""
    result = VerdictResult(default, candidates, level, "", max_rounds)
    started = clock()
    slowest = 0.0
    for r in range(max_rounds):
        if r >= 2 and clock() - started + slowest > budget_s:
            result.stopped = f"time budget ({budget_s:.0f}s) used after {r} rounds"
            return result
        t0 = clock()
        everyone = [default] + candidates
        for c in (everyone if r % 2 == 0 else everyone[::-1]):
            cap, ceiling, toks = round_capacity(c, first_draw + r)
            c.rounds.append(cap)
            c.ceilings.append(ceiling)
            c.tokens.append(toks if toks is not None else math.nan)
        slowest = max(slowest, clock() - t0)
        if on_round is not None:
            on_round(r + 1, result)
        best = result.best
        if r >= 1 and best is not None and ratio_verdict(result.ratio(best)) != "no difference beyond the noise":
            result.stopped = f"the ratio's interval excludes 1 after {r + 1} rounds"
            return result
    result.stopped = f"{max_rounds} rounds"
    return result


def verdict_line(result: VerdictResult, slo_text: str) -> str:
    """The last line of ``tune``: what the tuned config serves, against the default config, with intervals."""
    d = result.default.capacity(result.level)
    w = result.winner
    if w is not None:
        c, ratio = w.capacity(result.level), result.ratio(w)
        return (f"tuned serves {c.format(' req/s', 1, 3)} within {slo_text}, {ratio.format('x', 1, 3)} the default "
                f"config's {d.format(' req/s', 1, 3)} ({len(w.rounds)} paired rounds; capacities at "
                f"{result.level:.0%}, the ratio at {result.ratio_level:.1%} for {result.max_rounds - 1} looks)")
    safe = result.safest
    best = result.best
    tail = ""
    if best is not None:
        tail = f"; best candidate {best.capacity(result.level).format(' req/s', 1, 3)}, ratio " \
               f"{result.ratio(best).format('x', 1, 3)}"
    return (f"no config beats the default beyond the noise within {slo_text}: default {d.format(' req/s', 1, 3)}"
            f"{tail}; safest: {safe.name} ({result.stopped})")
