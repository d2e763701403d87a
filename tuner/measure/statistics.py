"""The intervals every deciding figure carries, and the verdicts drawn from them.

- A percentile (p99 TBT of pooled gaps, p99 TTFT of requests) gets a distribution-free interval from the order
  statistics of its samples: the number of samples below the true q-quantile is Binomial(n, q), so the ranks
  whose binomial probabilities enclose `level` bound it. With too few samples one side is unbounded (a p99 from
  150 gaps has no finite upper bound at 95 %: it cannot be shown to meet a target).
- A share of independent outcomes gets the Clopper-Pearson interval of its binomial count. Requests are not
  independent (those that queue behind one burst attain or miss together): a measurement's attainment is judged on
  blocks of them (tuner/measure/dependence.py).

A figure is compared with its target through its interval: "met", "missed", or "undecided" when the interval
straddles the target. None of this imports torch, locust or optuna.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Literal

import numpy as np
from scipy import stats

Verdict = Literal["met", "missed", "undecided"]
DEFAULT_LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A point estimate with its two-sided confidence interval (bounds may be infinite: not bounded by the data)."""

    value: float
    low: float
    high: float
    level: float
    n: int

    def as_dict(self) -> dict[str, float | int | None]:
        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {"value": finite(self.value), "low": finite(self.low), "high": finite(self.high),
                "level": self.level, "n": self.n}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Interval:
        """An interval as :meth:`as_dict` wrote it (an unbounded side, or no value, read back as such)."""
        def read(key: str, missing: float) -> float:
            return missing if d.get(key) is None else float(d[key])

        return cls(read("value", math.nan), read("low", -math.inf), read("high", math.inf), float(d["level"]),
                   int(d.get("n") or 0))

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high

    def format(self, unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
        """``45.2 ms (38.1-51.0)``; an unbounded side reads ``?``."""
        def f(x: float) -> str:
            return f"{x * scale:.{digits}g}" if math.isfinite(x) else "?"

        return f"{f(self.value)}{unit} ({f(self.low)}-{f(self.high)})"


def quantile_ranks(n: int, q: float, level: float = DEFAULT_LEVEL) -> tuple[int, int]:
    """1-based ranks (l, u) of the order statistics bounding the q-quantile with probability >= level;
    l = 0 means no lower bound, u = n + 1 no upper bound."""
    if n <= 0:
        return 0, 1
    alpha = 1.0 - level
    binom = stats.binom(n, q)
    # P(X_(l) <= xi_q) = P(B >= l) and P(X_(u) >= xi_q) = P(B <= u - 1), B = #samples below the quantile.
    low = int(binom.ppf(alpha / 2))  # largest l with P(B < l) <= alpha/2
    while low > 0 and binom.cdf(low - 1) > alpha / 2:
        low -= 1
    high = int(binom.ppf(1 - alpha / 2)) + 1
    while high <= n and binom.cdf(high - 1) < 1 - alpha / 2:
        high += 1
    return low, min(high, n + 1)


def quantile_interval(samples: Sequence[float] | np.ndarray, q: float = 0.99,
                      level: float = DEFAULT_LEVEL) -> Interval:
    """The q-quantile (numpy's linear interpolation, as the load test's summary) and its order-statistic
    interval. NaN value and unbounded sides for no samples."""
    x = np.sort(np.asarray(samples, dtype=float))
    n = int(x.size)
    if n == 0:
        return Interval(math.nan, -math.inf, math.inf, level, 0)
    lo_rank, hi_rank = quantile_ranks(n, q, level)
    low = float(x[lo_rank - 1]) if lo_rank >= 1 else -math.inf
    high = float(x[hi_rank - 1]) if hi_rank <= n else math.inf
    return Interval(float(np.quantile(x, q)), low, high, level, n)


def min_samples_to_bound(q: float = 0.99, level: float = DEFAULT_LEVEL) -> int:
    """The fewest samples whose largest one is an upper confidence bound of the q-quantile (one-sided, at
    (1 + level) / 2 as in the two-sided interval): below it no p99 can be shown to meet a target."""
    alpha = (1.0 - level) / 2
    return math.ceil(math.log(alpha) / math.log(q))


@functools.lru_cache(maxsize=65536)  # pure, and each call a root search: the stopping rules ask the same ones often
def proportion_interval(successes: int, trials: int, level: float = DEFAULT_LEVEL) -> Interval:
    """A share with its Clopper-Pearson (exact binomial) interval; NaN and [0, 1] for no trials."""
    if trials <= 0:
        return Interval(math.nan, 0.0, 1.0, level, 0)
    ci = stats.binomtest(successes, trials).proportion_ci(confidence_level=level, method="exact")
    return Interval(successes / trials, float(ci.low), float(ci.high), level, trials)


def bonferroni_level(level: float, looks: int) -> float:
    """The level of each of ``looks`` claims that must hold together at ``level``: each gets an equal share of the
    error rate (Bonferroni), so that the first of them to go wrong does so with probability at most 1 - level."""
    return 1.0 - (1.0 - level) / max(1, looks)


def upper_verdict(estimate: Interval, target: float) -> Verdict:
    """A figure that must stay at or below `target` (a latency percentile)."""
    if estimate.n == 0:
        return "undecided"
    if estimate.high <= target:
        return "met"
    if estimate.low > target:
        return "missed"
    return "undecided"


def lower_verdict(estimate: Interval, target: float) -> Verdict:
    """A figure that must reach `target` (attainment against its share)."""
    if estimate.n == 0:
        return "undecided"
    if estimate.low >= target:
        return "met"
    if estimate.high < target:
        return "missed"
    return "undecided"


def wilson_interval(successes: int, trials: int, level: float = DEFAULT_LEVEL) -> tuple[float, float]:
    """The Wilson score interval of a binomial share (closed form; trials > 0)."""
    z = NormalDist().inv_cdf(0.5 + level / 2)
    p, z2 = successes / trials, z * z
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def proportion_difference_interval(successes_a: int, trials_a: int, successes_b: int, trials_b: int,
                                   level: float = DEFAULT_LEVEL) -> Interval:
    """The difference of two independent shares, a - b (a canary's attainment against the applied config's), with
    Newcombe's hybrid score interval (from each share's Wilson interval; good coverage for small counts and shares
    near 0 or 1, where the Wald interval fails). NaN and [-1, 1] when either side has no trials."""
    if trials_a <= 0 or trials_b <= 0:
        return Interval(math.nan, -1.0, 1.0, level, min(trials_a, trials_b, 0))
    pa, pb = successes_a / trials_a, successes_b / trials_b
    a_low, a_high = wilson_interval(successes_a, trials_a, level)
    b_low, b_high = wilson_interval(successes_b, trials_b, level)
    diff = pa - pb
    low = diff - math.sqrt((pa - a_low) ** 2 + (b_high - pb) ** 2)
    high = diff + math.sqrt((a_high - pa) ** 2 + (pb - b_low) ** 2)
    return Interval(diff, max(-1.0, low), min(1.0, high), level, min(trials_a, trials_b))
