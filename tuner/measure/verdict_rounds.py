"""The verdict's rounds (tuner/measure/verdict.py says what it claims): where each config is measured next, and when
the rounds stop.

- a candidate: first one step (or two) below its searched capacity (:func:`first_rate`); while its pool there is not
  shown served and another round cannot show it, down toward the default's ceiling (:func:`plan_next`): two rates
  at most;
- the default: beside each undecided candidate on the same arrivals, and at its own ceiling while a miss there is
  within reach (:func:`default_rates`);
- the winner, once shown better: a climb toward the lowest rate above its shown-served one that it was not shown to
  serve (:func:`plan_climb`), each climb started only once the rate below it was shown served.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from tuner.measure.verdict import RATES_PER_CANDIDATE, Contender, Pool, Sample, VerdictResult, rate_key
from tuner.measure.statistics import DEFAULT_LEVEL

# measure(contender, rate, draw) -> the sample of one measurement (sized by the verdict)
MeasureAt = Callable[[Contender, float, int], Sample]
Plan = list[tuple[Contender, float]]  # a round's measurements: (config, rate)


def plan_next(c: Contender, step: float, floor: float, more_blocks: int, default_missed: float = math.inf,
              default_high: float = math.inf) -> None:
    """Where candidate ``c`` is measured next round, from its pool at the rate just measured; ``more_blocks``: the
    blocks another round adds there. It stays while another round may show it served; else it steps down
    (:func:`step_down`), or straight to ``default_missed`` where the default is already shown missed lower: the
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
        down = step_down(rate, default_high, step)
        if default_missed < down * (1 - 1e-9):
            down = default_missed
        fits = down >= floor * (1 - 1e-9) and len(c.pools) < RATES_PER_CANDIDATE
        c.next_rate = down if fits else None


def step_down(rate: float, default_high: float, step: float) -> float:
    """A candidate's second rate, below the ``rate`` where it was not shown served: the geometric middle of that rate
    and the default's searched ceiling ``default_high``, a step down at least. Near its knee a candidate attains
    only a few points more a step or two lower, too few to be shown in a window (on the Azure trace 96.8 % at 5.94
    req/s, two steps below the 90.3 % of its first rate, left it undecided while the default attained 51 % there);
    at the middle it attains all its requests while the default still misses, and a winner climbs back toward its
    knee afterwards (:func:`plan_climb`). Without a searched ceiling, as its first rate was placed."""
    if not math.isfinite(default_high):
        return first_rate(rate, default_high, step)
    return min(rate / step, math.sqrt(rate * default_high))


def plan_climb(c: Contender, step: float, more_blocks: int) -> None:
    """Where the winner ``c`` is measured next round: at its climb while another round may show it served there,
    else at the next climb (:func:`climb_rate`), its pool judged at the candidates' level and claiming "served" only;
    None when the climbing is over."""
    pool = c.pool(c.next_rate) if c.next_rate is not None else None
    if (pool is not None and pool.served_only and pool.verdict() == "undecided"
            and pool.within_reach("met", more_blocks)):
        return
    c.next_rate = climb_rate(c, step)
    if c.next_rate is not None:
        c.climbs.add(c.next_rate)


def climb_rate(c: Contender, step: float) -> float | None:
    """The winner's next climb: the geometric middle of its highest rate shown served and the lowest rate above it
    not shown served (its searched claim, where none is), while they are two steps apart or more (a climb gains a
    step at least: a winner shown served at its first rate two steps below its searched capacity climbs to one step
    below it). None once a climb was not shown served: a further climb would not rest on the one below it."""
    if any(p.served_only and p.verdict() != "met" for p in c.pools.values()):
        return None
    low = c.shown().low
    high = min((p.rate for p in c.pools.values() if p.rate > low * (1 + 1e-9) and p.verdict() != "met"),
               default=c.claim)
    if low <= 0 or high < low * step ** 2 * (1 - 1e-9):
        return None
    return rate_key(math.sqrt(low * high))


def climbed(c: Contender) -> str:
    """The stop line's note of the winner's climbs (empty without one)."""
    climbs = sorted(p.rate for p in c.pools.values() if p.served_only)
    if not climbs:
        return ""
    return f", then climbed to {', '.join(f'{r:.3g}' for r in climbs)} req/s (shown served to {c.shown().low:.3g})"


def default_rates(result: VerdictResult, step: float) -> list[float]:
    """Where the default config is measured this round: beside each undecided candidate at its rate (paired on the
    same arrivals), and at its own searched ceiling (a step above the lowest rate its search read below the target
    share, when that is below the candidates' rates); at each until its pool there is decided."""
    d = result.default
    rates = [c.next_rate for c in result.candidates if result.outcome(c) == "undecided" and c.next_rate is not None]
    own = ceiling_rate(d, step)
    below = rates + ([result.winner.shown().low] if result.winner is not None else [])
    if below and own is not None and own < min(below) * (1 - 1e-9) and may_show_missed(d.pool(own)):
        rates.append(own)
    return sorted(r for r in set(rate_key(r) for r in rates)
                  if (pool := d.pool(r)) is None or pool.verdict() == "undecided")


def ceiling_open(result: VerdictResult, step: float) -> bool:
    """Whether the default's own ceiling, below the winner's shown-served rate, may still be shown missed (a miss
    there would give the ratio a multiple)."""
    own, w = ceiling_rate(result.default, step), result.winner
    if own is None or w is None or own >= w.shown().low * (1 - 1e-9):
        return False
    return may_show_missed(result.default.pool(own))


def may_show_missed(pool: Pool | None) -> bool:
    """Whether the default's pool at its own ceiling is worth another window: not yet measured (or only void), or
    undecided with "missed" within reach of one more window as long as its last. Only a miss there counts (it gives
    the ratio a multiple); a ceiling the default attains 92-98 % at in 60 s windows is never shown missed, and on the
    engine three further rounds spent four minutes on one, deciding nothing."""
    if pool is None or not pool.requests:
        return True
    return pool.verdict() == "undecided" and pool.within_reach("missed", window_blocks(pool))


def window_blocks(pool: Pool | None) -> int:
    """The blocks another window at ``pool``'s rate adds: as many as its last window that measured (a void one,
    where the measuring machinery failed, says nothing of the next), at least one."""
    if pool is None:
        return 1
    last = next((s for s in reversed(pool.samples) if s.void is None), None)
    return max(1, len(last.blocks)) if last is not None else 1


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


def what_fits(plan: Plan, left_s: float, cost: Callable[[Plan], float] | None, slowest: float) -> Plan:
    """The measurements of a round that fit in ``left_s`` (``cost`` of them, else ``slowest``, the slowest round so
    far): all of them, else all but the default's at its own ceiling, else none. That one decides no candidate's
    outcome (it gives the ratio a multiple, or a lower rate to step down to), while a candidate's step down or climb,
    and the default beside it, do."""
    beside = {rate_key(rate) for c, rate in plan if not c.is_default}
    for measurements in (plan, [(c, rate) for c, rate in plan if not c.is_default or rate_key(rate) in beside]):
        if measurements and (cost(measurements) if cost is not None else slowest) <= left_s:
            return measurements
    return []


def paired_verdict(default: Contender, candidates: list[Contender], measure_at: MeasureAt, max_rounds: int = 4,
                   budget_s: float = 300.0, level: float = DEFAULT_LEVEL, step: float = 1.15, floor: float = 0.0,
                   first_draw: int = 100, on_round: Callable[[int, VerdictResult], None] | None = None,
                   clock: Callable[[], float] = time.monotonic,
                   cost: Callable[[Plan], float] | None = None) -> VerdictResult:
    """Rounds on fresh draws (one per round, shared by every config in it; the order alternating) until every
    candidate's outcome is decided (or one is better and no undecided one could beat it), nothing is left to
    measure, the rounds run out, or the next round would not fit in what is left of ``budget_s`` (``cost`` of its
    measurements, else the slowest round so far; the first round always runs; a round that does not fit whole runs
    without the default's own ceiling where the rest fits: :func:`what_fits`). ``floor``: the lowest rate a
    candidate steps down to. Rounds cost no error rate: at each rate they continue one confidence sequence."""
    result = VerdictResult(default, candidates, level, max_rounds)
    started, slowest = clock(), 0.0
    for r in range(max_rounds):
        plan = [(default, rate) for rate in default_rates(result, step)]
        plan += [(c, rate) for c in candidates
                 if (rate := c.next_rate) is not None and (result.outcome(c) == "undecided" or c is result.winner)]
        if not plan:
            result.stopped = f"nothing left to measure could decide, after {r} rounds"
            return result
        if r >= 1 and not (plan := what_fits(plan, budget_s - (clock() - started), cost, slowest)):
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
            more = window_blocks(c.pool(c.next_rate) if c.next_rate is not None else None)
            if c is result.winner:
                plan_climb(c, step, more)
            else:
                plan_next(c, step, floor, more, default.shown().high, default.search_high)
        slowest = max(slowest, clock() - t0)
        if on_round is not None:
            on_round(r + 1, result)
        w = result.winner
        if w is not None and not any(result.outcome(c) == "undecided" and c.claim > w.shown().low
                                     for c in candidates):
            # the winner is decided; it may climb, and the default's own ceiling may still give the ratio a multiple
            left = ([(default, ceiling_rate(default, step) or 0.0)] if ceiling_open(result, step) else []) + \
                ([(w, w.next_rate)] if w.next_rate is not None else [])
            if r + 1 >= max_rounds or not what_fits(left, budget_s - (clock() - started), cost, slowest):
                result.stopped = f"{w.name} shown better after {r + 1} rounds" + climbed(w)
                return result
    decided = all(result.outcome(c) != "undecided" for c in candidates)
    rounds = max(c.rounds for c in [default] + candidates)
    result.stopped = f"decided after {rounds} rounds" if decided else f"{max_rounds} rounds"
    return result
