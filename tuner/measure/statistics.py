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


def proportion_difference_interval(successes_a: int, trials_a: int, successes_b: int, trials_b: int,
                                   level: float = DEFAULT_LEVEL) -> Interval:
    """The difference of two independent shares, a - b (a canary's attainment against the window before it), with
    Newcombe's hybrid score interval (from each share's Wilson interval; good coverage for small counts and shares
    near 0 or 1, where the Wald interval fails). NaN and [-1, 1] when either side has no trials."""
    if trials_a <= 0 or trials_b <= 0:
        return Interval(math.nan, -1.0, 1.0, level, min(trials_a, trials_b, 0))
    pa, pb = successes_a / trials_a, successes_b / trials_b
    ca = stats.binomtest(successes_a, trials_a).proportion_ci(confidence_level=level, method="wilson")
    cb = stats.binomtest(successes_b, trials_b).proportion_ci(confidence_level=level, method="wilson")
    diff = pa - pb
    low = diff - math.sqrt((pa - ca.low) ** 2 + (cb.high - pb) ** 2)
    high = diff + math.sqrt((ca.high - pa) ** 2 + (pb - cb.low) ** 2)
    return Interval(diff, max(-1.0, low), min(1.0, high), level, min(trials_a, trials_b))


def rate_ratio_interval(count_a: int, seconds_a: float, count_b: int, seconds_b: float,
                        level: float = DEFAULT_LEVEL) -> Interval:
    """The ratio of two Poisson rates, (count_a / seconds_a) / (count_b / seconds_b), with the exact interval
    conditional on the total (count_a given the total is binomial): arrival rates of two windows. Unbounded
    sides where a count is zero."""
    total = count_a + count_b
    if total == 0 or seconds_a <= 0 or seconds_b <= 0:
        return Interval(math.nan, 0.0, math.inf, level, 0)
    share = proportion_interval(count_a, total, level)
    scale = seconds_b / seconds_a

    def odds(p: float) -> float:
        return math.inf if p >= 1.0 else p / (1.0 - p) * scale

    value = odds(count_a / total) if count_b else math.inf
    return Interval(value, odds(share.low), odds(share.high), level, total)


def mean_ratio_interval(samples_a: Sequence[float], samples_b: Sequence[float],
                        level: float = DEFAULT_LEVEL) -> Interval:
    """The ratio of two independent samples' means, mean(a) / mean(b), from Welch's t interval of the difference
    scaled by mean(b) (mean lengths of two windows, one sample per scrape interval). Unbounded with fewer than two
    samples on a side or a non-positive mean(b)."""
    a, b = np.asarray(samples_a, dtype=float), np.asarray(samples_b, dtype=float)
    n = int(min(a.size, b.size))
    if a.size < 2 or b.size < 2 or float(b.mean()) <= 0:
        return Interval(math.nan, 0.0, math.inf, level, n)
    mb = float(b.mean())
    if float(a.std()) == 0.0 and float(b.std()) == 0.0:
        r = float(a.mean()) / mb
        return Interval(r, r, r, level, n)
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(confidence_level=level)
    return Interval(float(a.mean()) / mb, 1.0 + float(ci.low) / mb, 1.0 + float(ci.high) / mb, level, n)


MIN_EXPECTED = 5.0  # the smallest expected count per cell for the chi-square approximation (Cochran's rule)


@dataclass(frozen=True)
class Homogeneity:
    """A chi-square test of homogeneity of two samples' counts over the same classes (the buckets of two windows'
    histograms), on adjacent classes merged until every cell's expected count is at least MIN_EXPECTED.

    ``groups`` are the merged classes as (first, last) indices of the given ones; ``distance`` is the total
    variation distance between the two samples' shares over those groups (the least share of one sample that must
    change class to make it look like the other). A p-value of NaN: not testable (an empty side, or one group)."""

    p_value: float
    statistic: float
    dof: int
    groups: tuple[tuple[int, int], ...]
    counts_a: tuple[float, ...]  # per group
    counts_b: tuple[float, ...]
    distance: float

    def as_dict(self) -> dict[str, object]:
        def finite(x: float) -> float | None:
            return round(x, 6) if math.isfinite(x) else None

        return {"p_value": finite(self.p_value), "statistic": finite(self.statistic), "dof": self.dof,
                "distance": finite(self.distance), "counts_a": [round(c) for c in self.counts_a],
                "counts_b": [round(c) for c in self.counts_b]}


def merged_classes(counts_a: Sequence[float], counts_b: Sequence[float],
                   min_expected: float = MIN_EXPECTED) -> tuple[tuple[int, int], ...]:
    """Adjacent classes merged from the first on until each group's smaller expected count (its total times the
    smaller sample's share of all) reaches ``min_expected``; a short remainder joins the last group. Classes empty
    on both sides at either end are left out."""
    na, nb = float(sum(counts_a)), float(sum(counts_b))
    if na <= 0 or nb <= 0:
        return ()
    share = min(na, nb) / (na + nb)
    totals = [a + b for a, b in zip(counts_a, counts_b)]
    filled = [i for i, t in enumerate(totals) if t > 0]
    groups: list[tuple[int, int]] = []
    start, acc = filled[0], 0.0
    for i in range(filled[0], filled[-1] + 1):
        acc += totals[i]
        if acc * share >= min_expected:
            groups.append((start, i))
            start, acc = i + 1, 0.0
    if acc > 0:  # the remainder is too small for a group of its own
        if groups:
            groups[-1] = (groups[-1][0], filled[-1])
        else:
            groups.append((start, filled[-1]))
    return tuple(groups)


def homogeneity_test(counts_a: Sequence[float], counts_b: Sequence[float],
                     min_expected: float = MIN_EXPECTED) -> Homogeneity:
    """Whether two samples' counts over the same ordered classes come from one distribution (see Homogeneity)."""
    groups = merged_classes(counts_a, counts_b, min_expected)
    a = tuple(float(sum(counts_a[i:j + 1])) for i, j in groups)
    b = tuple(float(sum(counts_b[i:j + 1])) for i, j in groups)
    if len(groups) < 2:
        return Homogeneity(math.nan, math.nan, 0, groups, a, b, 0.0 if groups else math.nan)
    na, nb = sum(a), sum(b)
    distance = 0.5 * sum(abs(x / na - y / nb) for x, y in zip(a, b))
    # no continuity correction: Yates' makes the 2x2 case conservative, well below the test's level
    result = stats.chi2_contingency(np.array([a, b]), correction=False)
    return Homogeneity(float(result.pvalue), float(result.statistic), int(result.dof), groups, a, b, distance)
