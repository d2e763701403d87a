"""The verdict: is the best candidate's capacity above the default config's, beyond the noise?

A capacity is a rate a config is *shown* to serve (>= 90 % of the requests attain the SLO, the attainment's interval
above 90 %). So one config beats another when it is shown to serve a rate the other is shown not to serve; both
facts are binomial counts at fixed rates, and counts at one rate pool across measurements. The verdict therefore
measures each config at a fixed rate per round instead of searching its capacity again:

- the candidate one step below the capacity its search claimed (the best of the searched configs on one draw is
  likely to have been lucky there), the default config at the same rate on the same draw (a miss there is what
  "better" needs);
- round after round on fresh arrival draws, the same draw for every config of a round (common random numbers), the
  order alternating; each config's requests at a rate pool across the rounds, so that an attainment at the edge
  (93 % against 90 %) gets the hundreds of requests it needs instead of a coin flip per round;
- a candidate not shown to serve its claim steps down a rate when its pool there was missed or is unlikely to reach
  "met" with one more measurement (rounds are few, so each goes where it likely decides), and the default follows
  it;
- the default's search probes pool with its verdict's (nothing selected it for them); a candidate's do not (it was
  picked for how its search draw went: the winner's curse), so its claimed capacity is only what fresh draws show.

The candidate is **better** when it is shown to serve a rate at or above one where the default is shown to miss, or
when, at a rate it is shown to serve, the default (shown to serve no rate up to there) attains fewer of the same
arrivals beyond the noise (a paired difference of the two attainments: a default at the edge of 90 % over a range
of rates is never shown to miss with the requests a run can afford);
**not better** when the default is shown to serve a rate at or above one where the candidate is shown to miss, or
the rate the candidate showed as its capacity. Each pooled verdict is looked at after every round, so each look
gets a Bonferroni share of the error rate (:func:`look_level`). A config's capacity is its bracket (the highest rate
shown served; the lowest not shown served), the ratio's interval the brackets' ratios (low: candidate's low /
default's high). A pool is judged at the strictest level of its looks: a search probe never re-measured keeps its
search's level.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from tuner.measure.measurement import TARGET_SHARE, MeasurementSpec, out_of_reach
from tuner.measure.statistics import (DEFAULT_LEVEL, Interval, Verdict, effective_proportion_interval, lower_verdict,
                                      proportion_difference_interval)

DEFAULT = "default"
Outcome = Literal["better", "not better", "undecided"]


@dataclass(frozen=True)
class Sample:
    """One measurement of a config at a rate on one arrival draw: its requests and how many attained."""

    rate: float
    draw: int  # -1: the default config's own search probes
    attaining: int
    requests: int
    failed: str | None = None  # a rejected config, a crashed engine: the config does not serve this rate
    output_tokens_per_s: float | None = None
    summary: str = ""  # the measurement's own line (its p99s with intervals)
    design_effect: float = 1.0  # of its attainment (requests queueing behind one burst attain or miss together)

    def as_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "draw": self.draw, "attaining": self.attaining, "requests": self.requests,
                "failed": self.failed, "output_tokens_per_s": self.output_tokens_per_s, "summary": self.summary,
                "design_effect": self.design_effect}


@dataclass
class Pool:
    """Every sample of a config at one rate, pooled, judged at the strictest level any of its looks needs (a search
    probe's own level; the verdict's per-look level once the verdict has measured there)."""

    rate: float
    level: float = DEFAULT_LEVEL
    samples: list[Sample] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(s.requests for s in self.samples)

    @property
    def attaining(self) -> int:
        return sum(s.attaining for s in self.samples)

    @property
    def failed(self) -> str | None:
        return next((s.failed for s in self.samples if s.failed), None)

    def design_effect(self) -> float:
        """The pool's design effect: its requests over their effective number (each sample's requests over its
        own design effect); 1 for an empty pool."""
        effective = sum(s.requests / s.design_effect for s in self.samples)
        return self.requests / effective if effective else 1.0

    def attainment(self) -> Interval:
        """The pooled share, its interval on the pool's effective counts."""
        return effective_proportion_interval(self.attaining, self.requests, self.design_effect(), self.level)

    def effective_counts(self) -> tuple[int, int]:
        """(attaining, requests) over the pool's design effect, rounded: what independent requests the pool's
        evidence is worth (at least one request when it has any)."""
        if not self.requests:
            return 0, 0
        deff = self.design_effect()
        return int(round(self.attaining / deff)), max(1, int(round(self.requests / deff)))

    def verdict(self, share: float = TARGET_SHARE) -> Verdict:
        if self.failed:
            return "missed"
        return lower_verdict(self.attainment(), share) if self.requests else "undecided"

    def likely(self, wanted: Verdict, more: int, share: float = TARGET_SHARE) -> bool:
        """Whether ``more`` further requests more likely than not bring the pooled verdict to ``wanted`` ("met" or
        "missed"), at an optimistic reading of the share so far (the measurement's futility rule at even odds): an
        attainment at the edge reaches neither in any budget, and the verdict's rounds are few."""
        spec = MeasurementSpec(level=self.level, target_share=share)
        return not out_of_reach(wanted, self.attaining, self.requests, self.requests + more, spec, chance=0.5)

    def as_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "requests": self.requests, "attaining": self.attaining, "level": self.level,
                "attainment": self.attainment().as_dict(), "verdict": self.verdict(),
                "samples": [s.as_dict() for s in self.samples]}


def rate_key(rate: float) -> float:
    """Pools are keyed by rate; rates computed by different paths (a bracket's end, a step down) agree to 1e-9."""
    return round(rate, 9)


@dataclass
class Contender:
    """A config in the verdict: its pools by rate, and the rate it is measured at next (None: nothing to show)."""

    name: str  # "default" or "candidate N (trial #k)"
    knobs: dict[str, Any]
    claim: float  # the capacity its search claimed (a candidate) / its search's ceiling (the default)
    search_high: float = math.inf  # the lowest rate its search did not show served
    pools: dict[float, Pool] = field(default_factory=dict)
    next_rate: float | None = None
    rounds: int = 0  # rounds it was measured in

    def __post_init__(self) -> None:
        if self.next_rate is None:
            self.next_rate = self.claim

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT

    def pool(self, rate: float) -> Pool | None:
        """The pool of the samples at ``rate`` (None: nothing measured there)."""
        return self.pools.get(rate_key(rate))

    def add(self, sample: Sample, level: float) -> Pool:
        """Pool ``sample`` with the others at its rate, judged from now on at ``level`` at least."""
        pool = self.pools.setdefault(rate_key(sample.rate), Pool(sample.rate, level))
        pool.samples.append(sample)
        pool.level = max(pool.level, level)
        return pool

    def rates(self, verdict: Verdict) -> list[float]:
        return sorted(p.rate for p in self.pools.values() if p.verdict() == verdict)

    def shown_served(self) -> float:
        """The highest rate shown served below every rate shown missed (0: none)."""
        missed = min(self.rates("missed"), default=math.inf)
        return max((r for r in self.rates("met") if r < missed), default=0.0)

    def shown_missed(self) -> float:
        """The lowest rate shown missed (inf: none)."""
        return min(self.rates("missed"), default=math.inf)

    def capacity(self) -> Interval:
        """The bracket: the highest rate shown served, the lowest rate above it not shown served (pooled here, or
        the search's ceiling when the verdict measured nothing higher); its level the strictest of its pools'."""
        low = self.shown_served()
        above = [p.rate for p in self.pools.values() if p.rate > low and p.verdict() != "met"]
        high = min(above + [self.search_high], default=math.inf)
        n = sum(p.requests for p in self.pools.values())
        level = max((p.level for p in self.pools.values()), default=DEFAULT_LEVEL)
        return Interval(low, low, max(high, low), level, n)

    def tokens_at(self, rate: float) -> float | None:
        """The mean output tokens/s of the samples at ``rate`` (None: none measured there)."""
        pool = self.pool(rate)
        values = [s.output_tokens_per_s for s in pool.samples if s.output_tokens_per_s] if pool else []
        return sum(values) / len(values) if values else None

    def as_dict(self) -> dict[str, Any]:
        cap = self.capacity()
        return {"knobs": self.knobs, "claim_req_per_s": self.claim, "capacity_req_per_s": cap.as_dict(),
                "output_tokens_per_s": self.tokens_at(cap.value), "rounds": self.rounds,
                "pools": [p.as_dict() for p in sorted(self.pools.values(), key=lambda p: p.rate)]}


def look_level(level: float, looks: int) -> float:
    """The level of each look: every pooled verdict is looked at after every round, so each of ``looks`` looks gets
    a Bonferroni share of the error rate and stopping at the first decision keeps the overall level."""
    return 1.0 - (1.0 - level) / max(1, looks)


@dataclass
class VerdictResult:
    default: Contender
    candidates: list[Contender]
    level: float  # the overall level
    max_rounds: int = 4
    stopped: str = ""

    @property
    def look(self) -> float:
        """The level every pooled verdict and bracket is judged at."""
        return look_level(self.level, self.max_rounds)

    def outcome(self, c: Contender) -> Outcome:
        served, missed = c.shown_served(), c.shown_missed()
        d_served, d_missed = self.default.shown_served(), self.default.shown_missed()
        if served > 0 and (served >= d_missed or self.attains_more(c, served)):
            return "better"
        # the default serves a rate the candidate misses, or serves what the candidate showed as its capacity
        if d_served > 0 and (d_served >= missed or (c.next_rate is None and d_served >= served)):
            return "not better"
        return "undecided"

    def paired_difference(self, c: Contender, rate: float) -> Interval | None:
        """The candidate's attainment at ``rate`` minus the default's there (Newcombe, at the per-look level), when
        both were measured at that rate (the verdict measures them there on the same draws)."""
        mine, theirs = c.pool(rate), self.default.pool(rate)
        if mine is None or theirs is None or not mine.requests or not theirs.requests:
            return None
        return proportion_difference_interval(*mine.effective_counts(), *theirs.effective_counts(), self.look)

    def attains_more(self, c: Contender, rate: float) -> bool:
        """At ``rate``, which the candidate is shown to serve: the default is not shown to serve it, nor any rate
        up to it, and attains fewer of the same arrivals beyond the noise. A default at the edge of 90 % over a
        range of rates (its long prefills stall a share of the requests at any load) is never shown to miss there
        with the requests a run can afford, but it serves less than the candidate where the candidate is shown to
        serve."""
        d = self.default
        theirs = d.pool(rate)
        if theirs is None or theirs.verdict() == "met" or d.shown_served():
            return False
        diff = self.paired_difference(c, rate)
        return diff is not None and diff.low > 0

    def ratio(self, c: Contender) -> Interval:
        """The capacities' ratio: value candidate's / default's capacity, interval the brackets' ends (low: the
        candidate's capacity over the default's lowest rate not shown served). A default shown to serve nothing
        has no finite ratio (value and high end unbounded)."""
        cc, dc = c.capacity(), self.default.capacity()
        value = cc.value / dc.value if dc.value > 0 else math.inf
        low = cc.low / dc.high if math.isfinite(dc.high) and dc.high > 0 else 0.0
        high = cc.high / dc.low if dc.low > 0 else math.inf
        return Interval(value, min(low, value), max(high, value), self.look, cc.n + dc.n)

    @property
    def best(self) -> Contender | None:
        """The candidate with the highest shown capacity (then the highest claim)."""
        if not self.candidates:
            return None
        return max(self.candidates, key=lambda c: (c.shown_served(), c.claim))

    @property
    def winner(self) -> Contender | None:
        """The best of the candidates shown better than the default, if any."""
        better = [c for c in self.candidates if self.outcome(c) == "better"]
        return max(better, key=lambda c: c.shown_served()) if better else None

    @property
    def safest(self) -> Contender:
        """No winner: the config with the highest rate shown served on the verdict's draws (the default on ties)."""
        everyone = [self.default] + self.candidates
        return max(everyone, key=lambda c: (c.shown_served(), c is self.default))

    def as_dict(self) -> dict[str, Any]:
        def entry(c: Contender) -> dict[str, Any]:
            d = c.as_dict()
            if not c.is_default:
                d["ratio_to_default"] = self.ratio(c).as_dict()
                d["outcome"] = self.outcome(c)
            return d

        return {"level": self.level, "look_level": self.look, "max_rounds": self.max_rounds, "stopped": self.stopped,
                "default": entry(self.default), "candidates": [entry(c) for c in self.candidates],
                "winner": self.winner.name if self.winner else None, "safest": self.safest.name}


# measure(contender, rate, draw) -> the sample of one measurement (sized by its own statistics)
MeasureAt = Callable[[Contender, float, int], Sample]


def plan_next(c: Contender, step: float, floor: float, more: int) -> None:
    """Where candidate ``c`` is measured next round, from its pool at the rate just measured; ``more``: the requests
    another round would add there (about the last sample's). None once its capacity is shown or it reached
    ``floor``."""
    rate = c.next_rate
    if rate is None:
        return
    pool = c.pool(rate)
    assert pool is not None, f"{c.name} was not measured at {rate} req/s"
    v = pool.verdict()
    if v == "met":
        c.next_rate = None  # its capacity is shown
    elif v == "missed" or not pool.likely("met", more):
        down = rate / step
        c.next_rate = down if down >= floor * (1 - 1e-9) else None


def default_rate(result: VerdictResult) -> float | None:
    """Where the default config is measured this round: at the rate of the leading undecided candidate (the
    highest it has shown served, else the rate it is measured at), so that each round pairs the two at one rate on
    one draw. A miss there is what "better" needs, and a config at the edge of 90 % over a range of rates (as the
    default's long prefills keep it) misses most surely at the highest rate that can still decide. None when
    nothing more of the default can decide: no candidate is undecided, or it is already shown to miss there."""
    undecided = [c for c in result.candidates if result.outcome(c) == "undecided"]
    rates = [c.shown_served() or c.next_rate for c in undecided]
    target = max((r for r in rates if r), default=None)
    if target is None or result.default.shown_missed() <= target * (1 + 1e-9):
        return None
    return target


def paired_verdict(default: Contender, candidates: list[Contender], measure_at: MeasureAt, max_rounds: int = 4,
                   budget_s: float = 300.0, level: float = DEFAULT_LEVEL, step: float = 1.3, floor: float = 0.0,
                   first_draw: int = 100, on_round: Callable[[int, VerdictResult], None] | None = None,
                   clock: Callable[[], float] = time.monotonic) -> VerdictResult:
    """Rounds of one measurement per config still needed on the round's draw, the order alternating, until every
    candidate's outcome is decided (or the best one is better), nothing is left to measure, the rounds run out, or
    the next round would not fit in what is left of ``budget_s`` (judged by the slowest round so far; the first
    round always runs). A candidate is measured at its planned rate (:func:`plan_next`), the default at the leading
    candidate's (:func:`default_rate`). ``floor``: the lowest rate a candidate steps down to."""
    result = VerdictResult(default, candidates, level, max_rounds)
    started, slowest = clock(), 0.0
    exhausted = False  # nothing left to measure that could decide
    for r in range(max_rounds):
        default.next_rate = default_rate(result)
        open_ = [c for c in candidates if result.outcome(c) == "undecided" and c.next_rate is not None]
        everyone = ([default] if default.next_rate is not None else []) + open_
        if not everyone:
            exhausted = True
            break
        if r >= 1 and clock() - started + slowest > budget_s:
            result.stopped = f"time budget ({budget_s:.0f}s) used after {r} rounds"
            return result
        t0 = clock()
        for c in (everyone if r % 2 == 0 else everyone[::-1]):
            rate = c.next_rate
            assert rate is not None
            sample = measure_at(c, rate, first_draw + r)
            c.add(sample, result.look)
            c.rounds += 1
            if not c.is_default:
                plan_next(c, step, floor, max(sample.requests, 1))
        slowest = max(slowest, clock() - t0)
        if on_round is not None:
            on_round(r + 1, result)
        w = result.winner
        if w is not None and not any(result.outcome(c) == "undecided" and c.claim > w.shown_served()
                                     for c in candidates):
            result.stopped = f"{w.name} shown better after {r + 1} rounds"
            return result
    decided = all(result.outcome(c) != "undecided" for c in candidates)
    rounds = max(c.rounds for c in [default] + candidates)
    result.stopped = (f"decided after {rounds} rounds" if decided else
                      f"nothing left to measure could decide, after {rounds} rounds" if exhausted else
                      f"{max_rounds} rounds")
    return result


def verdict_line(result: VerdictResult, slo_text: str) -> str:
    """The last line of ``tune``: what the tuned config serves, against the default config, with intervals."""
    look = result.look
    d = result.default.capacity()
    d_text = (f"{d.format(' req/s', 1, 3)}" if d.value > 0 else
              f"0 req/s (not shown to serve {d.high:.3g} req/s)")
    w = result.winner
    note = (f"brackets at {result.level:.0%} from the searches, {look:.1%} where the verdict measured "
            f"({result.max_rounds} looks)")
    rounds = max(c.rounds for c in [result.default] + result.candidates)
    if w is not None:
        c, ratio = w.capacity(), result.ratio(w)
        ratio_text = ratio.format("x", 1, 3) if math.isfinite(ratio.value) else f">= {ratio.low:.3g}x"
        return (f"tuned serves {c.format(' req/s', 1, 3)} within {slo_text}, {ratio_text} the default "
                f"config's {d_text} ({rounds} round{'s' if rounds != 1 else ''} of fresh draws; {note})")
    best = result.best
    tail = ""
    if best is not None:
        tail = (f"; best candidate {best.capacity().format(' req/s', 1, 3)} ({result.outcome(best)}), ratio "
                f"{result.ratio(best).format('x', 1, 3)}")
        served = best.shown_served()
        diff = result.paired_difference(best, served) if served > 0 else None
        if diff is not None:
            tail += (f"; at {served:.3g} req/s it attains {diff.format(' points', 100, 3)} more of the same arrivals "
                     f"than the default")
    return (f"no config beats the default beyond the noise within {slo_text}: default {d_text}{tail}; safest: "
            f"{result.safest.name} ({result.stopped}; {note})")
