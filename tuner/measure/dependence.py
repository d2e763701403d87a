"""Intervals that hold under the dependence real traffic has.

Requests that queue behind one burst, or that share one slow step, attain or miss together: n such requests carry
less evidence than n independent ones, and how much less cannot be read off a window in which every request attained
(its misses, had there been any, might have come in one long episode). So a share is judged on *blocks*: the requests
of a window in send order, cut into consecutive blocks of at least as many requests as one queue episode holds
(:func:`block_counts`; the measurement sizes them from the rate and the episode allowance of the policy). Blocks are
taken as independent of each other; within a block the outcomes may depend on each other in any way.

- A share (attainment) gets a confidence *sequence* of the mean of its blocks' shares
  (:func:`mean_confidence_sequence`: Waudby-Smith and Ramdas' betting confidence sequence for bounded means, with the
  predictable plug-in bets and the hedged capital). It holds at every look at once: a measurement may look after every
  window and a verdict after every round, and stop at the first decision, without spending more of its error rate.
  A block of requests that all attained counts as one observation of a share in [0, 1], never as many independent
  requests: showing 90 % from blocks that all attained takes about 55 of them at 95 %.
- The paired difference of two configs measured on the same arrivals (block i of each the same requests) gets the same
  confidence sequence on the blocks' differences (:func:`paired_difference_interval`).
- A percentile of gaps or TTFTs gets an order-statistic interval on the effective number of samples
  (:func:`clustered_quantile_interval`): Woodruff's interval, the variance of the share below the estimate taken from
  the clusters' totals (the gaps ending in one stretch of time; one step's gaps repeat once per running sequence), with
  a chi-square allowance for that variance's own error.

Nothing here imports torch, locust or optuna.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

from tuner.measure.statistics import DEFAULT_LEVEL, Interval, quantile_ranks

Block = tuple[int, int]  # (attaining, requests) of consecutive requests
GRID = 2048  # the confidence sequence's ends are found to 1 / GRID of [0, 1] (and the target evaluated exactly) ...
COARSE = 64  # ... from a first look at this many steps
BET_CAP = 0.9  # the largest share of its capital a bet risks (Waudby-Smith and Ramdas truncate at 0.5-0.75; 0.9 shows a
# share near 1 in ~15 % fewer blocks, and any cap below 1 keeps the level)


def block_counts(outcomes: Sequence[bool] | np.ndarray, block: int) -> list[Block]:
    """``outcomes`` (in send order) cut into consecutive blocks of ``block`` requests from the first on, the remainder
    joined to the last block (a window shorter than one block is one block). Two configs measured on the same
    arrivals get the same blocks, however long each window ran: block i holds the same requests in both."""
    y = np.asarray(outcomes, dtype=bool)
    size = max(1, int(block))
    k = max(1, y.size // size)
    if y.size == 0:
        return []
    ends = [size * (i + 1) for i in range(k - 1)] + [y.size]
    starts = [0] + ends[:-1]
    return [(int(y[a:b].sum()), b - a) for a, b in zip(starts, ends)]


def _plug_in_bets(x: np.ndarray, alpha: float) -> np.ndarray:
    """The predictable plug-in bet of each observation (it sees only the ones before it)."""
    t = np.arange(1, x.size + 1, dtype=float)
    mean = (0.5 + np.cumsum(x)) / (t + 1)
    var = (0.25 + np.cumsum((x - mean) ** 2)) / (t + 1)
    previous = np.concatenate([[0.25], var[:-1]])
    return np.sqrt(2 * math.log(2 / alpha) / (previous * t * np.log1p(t)))


def _kept(x: np.ndarray, bets: np.ndarray, grid: np.ndarray, alpha: float) -> np.ndarray:
    """Which candidate means in ``grid`` no look of the sequence excluded."""
    m = grid[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        up = np.minimum(bets, np.where(m > 0, BET_CAP / m, np.inf))  # against means below the data
        down = np.minimum(bets, np.where(m < 1, BET_CAP / (1 - m), np.inf))  # against means above them
        log_up = np.cumsum(np.log1p(up * (x[:, None] - m)), axis=0)
        log_down = np.cumsum(np.log1p(-down * (x[:, None] - m)), axis=0)
    # hedged capital: each side bets half, so a mean is excluded once either side's capital reaches 2 / alpha
    excluded = np.maximum(np.nan_to_num(log_up, nan=-np.inf), np.nan_to_num(log_down, nan=-np.inf)) >= math.log(
        2 / alpha)
    return ~excluded.any(axis=0)  # excluded at any look stays excluded


def mean_confidence_sequence(values: Sequence[float] | np.ndarray, level: float = DEFAULT_LEVEL,
                             target: float | None = None) -> Interval:
    """The mean of independent observations in [0, 1] with its confidence sequence after the last of them: the
    intersection of the sequence's sets over every prefix, so that looking after each observation and stopping at the
    first decision keeps ``level``. Its ends are found to 1 / GRID: on a coarse grid first, then within the coarse
    steps where they lie; ``target`` is evaluated exactly (a bound equal to it is decided). [0, 1] for no
    observations."""
    x = np.clip(np.asarray(values, dtype=float), 0.0, 1.0)
    if x.size == 0:
        return Interval(math.nan, 0.0, 1.0, level, 0)
    alpha = 1.0 - level
    bets = _plug_in_bets(x, alpha)[:, None]
    coarse = np.linspace(0.0, 1.0, COARSE + 1)
    kept = _kept(x, bets, coarse, alpha)
    if not kept.any():  # every mean excluded between grid points (a very tight set): look closer around the data
        coarse = np.linspace(max(0.0, x.mean() - 2 / COARSE), min(1.0, x.mean() + 2 / COARSE), COARSE + 1)
        kept = _kept(x, bets, coarse, alpha)
    if not kept.any():
        centre = float(x.mean())
        return Interval(centre, centre, centre, level, int(x.size))
    first, last = int(np.argmax(kept)), int(len(kept) - 1 - np.argmax(kept[::-1]))
    step = coarse[1] - coarse[0]
    fine = np.concatenate([np.linspace(coarse[first] - step, coarse[first], GRID // COARSE + 1),
                           np.linspace(coarse[last], coarse[last] + step, GRID // COARSE + 1),
                           [] if target is None else [target]])
    fine = fine[(fine >= 0.0) & (fine <= 1.0)]
    inside = np.concatenate([fine[_kept(x, bets, fine, alpha)], coarse[kept]])
    return Interval(float(x.mean()), float(inside.min()), float(inside.max()), level, int(x.size))


def attainment_interval(blocks: Sequence[Block], level: float = DEFAULT_LEVEL,
                        target: float | None = None) -> Interval:
    """A share of requests (attaining / all) with the confidence sequence of its blocks' shares; ``n`` the requests."""
    requests = sum(n for _, n in blocks)
    if requests <= 0:
        return Interval(math.nan, 0.0, 1.0, level, 0)
    cs = _cached_sequence(tuple((a / n) for a, n in blocks if n > 0), level, target)
    share = sum(a for a, _ in blocks) / requests
    return Interval(share, min(cs.low, share), max(cs.high, share), level, requests)


@functools.lru_cache(maxsize=8192)  # the stopping rules look at the same pools again
def _cached_sequence(shares: tuple[float, ...], level: float, target: float | None) -> Interval:
    return mean_confidence_sequence(shares, level, target)


def paired_difference_interval(blocks_a: Sequence[Block], blocks_b: Sequence[Block],
                               level: float = DEFAULT_LEVEL) -> Interval:
    """The share of a minus the share of b, measured on the same arrivals: block i of a and of b hold the same
    requests, so each block's difference is one paired observation (in [-1, 1]); the confidence sequence of their
    mean. Blocks present on one side only (a measurement cut short) are left out; NaN and [-1, 1] without pairs."""
    pairs = [(x / n, y / m) for (x, n), (y, m) in zip(blocks_a, blocks_b) if n > 0 and m > 0]
    if not pairs:
        return Interval(math.nan, -1.0, 1.0, level, 0)
    diffs = np.array([x - y for x, y in pairs])
    cs = mean_confidence_sequence((diffs + 1.0) / 2.0, level, 0.5)
    value = float(diffs.mean())
    return Interval(value, min(2 * cs.low - 1, value), max(2 * cs.high - 1, value), level, len(pairs))


def cluster_design_effect(indicator: np.ndarray, clusters: np.ndarray, level: float = DEFAULT_LEVEL) -> float:
    """How many times the variance of the share of ``indicator`` exceeds the binomial one when the samples come in
    ``clusters`` (ids): the between-cluster variance of the ratio estimator over the binomial variance, raised by
    the upper end of a chi-square interval of that variance (its own error, with the clusters' number less one degrees
    of freedom). At least 1; 1 with fewer than two clusters or an all-equal indicator (nothing to estimate from)."""
    y = np.asarray(indicator, dtype=float)
    ids, inverse = np.unique(np.asarray(clusters), return_inverse=True)
    k = ids.size
    p = float(y.mean()) if y.size else 0.0
    if k < 2 or p <= 0.0 or p >= 1.0:
        return 1.0
    totals = np.bincount(inverse, weights=y, minlength=k)
    sizes = np.bincount(inverse, minlength=k).astype(float)
    residual = totals - p * sizes
    var_ratio = k / (k - 1) * float((residual ** 2).sum()) / y.size ** 2
    allowance = (k - 1) / float(stats.chi2.ppf((1 - level) / 2, k - 1))
    return max(1.0, var_ratio * allowance / (p * (1 - p) / y.size))


def clustered_quantile_interval(samples: Sequence[float] | np.ndarray, clusters: Sequence[int] | np.ndarray,
                                q: float = 0.99, level: float = DEFAULT_LEVEL) -> Interval:
    """The q-quantile of ``samples`` (numpy's linear interpolation) with Woodruff's interval on their effective number:
    the order-statistic ranks of an independent sample of n / design effect, where the design effect is that of the
    share below the estimate over ``clusters`` (:func:`cluster_design_effect`). With independent samples (every
    cluster one sample) it is the plain order-statistic interval. Unbounded sides where the effective sample is too
    small to bound them; NaN for no samples."""
    x = np.asarray(samples, dtype=float)
    n = int(x.size)
    if n == 0:
        return Interval(math.nan, -math.inf, math.inf, level, 0)
    order = np.argsort(x, kind="stable")
    xs = x[order]
    estimate = float(np.quantile(xs, q))
    deff = cluster_design_effect(x <= estimate, np.asarray(clusters)[order] if len(clusters) == n else
                                 np.arange(n), level)
    effective = max(1, int(math.floor(n / deff)))
    lo_rank, hi_rank = quantile_ranks(effective, q, level)
    # ranks of the effective sample, mapped to the same shares of the real one
    low = float(xs[max(0, math.ceil(lo_rank / effective * n) - 1)]) if lo_rank >= 1 else -math.inf
    high = float(xs[min(n, math.ceil(hi_rank / effective * n)) - 1]) if hi_rank <= effective else math.inf
    return Interval(estimate, min(low, estimate), max(high, estimate), level, n)
