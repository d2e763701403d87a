"""A canary judged against the applied config over the same stretch of traffic: a switchback on one engine, a
crossover on a fleet.

On one engine the candidate and the applied config take turns in blocks (``canary.block`` seconds each), two
blocks to a pair, which config goes first in a pair drawn at random. On a fleet two groups of replicas (drawn at
random, each ``canary.share`` of the fleet, one replica at least; two replicas: one each) trade the candidate: in
each block one group runs it while the other runs the applied config as its control over the same seconds, and which
group runs it first in a pair is drawn at random; the pair's difference averages the two blocks' (the replicas' own
differences cancel). Replicas in neither group keep the applied config and are not measured: a control that never
trades would break the symmetry the test rests on. The first ``canary.settle`` seconds of a block are not measured
(requests of the config before are still finishing); the rest gives the block's attainment. The decision to keep
rests on the pairs' differences (candidate minus applied) alone:

- **one budget**: the candidate is kept only when every planned pair is in and the sign-flip (randomisation) test
  of the mean difference rejects "no better" at ``canary.level`` (one-sided). The order within each pair was drawn
  at random, so under "the candidate makes no difference" each pair's sign is a fair coin whatever the traffic did:
  bursts that make a block's requests miss together, a trend, a shift in mid-canary, the window that fired the
  trigger. The test is exact at its level for any such traffic. Where the plan grows (below), it looks twice, at
  the planned pairs and at the end, each at half the level.
- **a rollback may come at any look**: attainment of the candidate's blocks pooled against the applied config's,
  or against the window before the canary, fallen by more than ``canary.rollback_drop`` beyond the noise. A
  rollback never keeps, so these looks cost the false-keep rate nothing (they cost power, which the sizing leaves
  room for).
- **the number of pairs is sized** from the rate and the gain to detect (the simulator's predicted gain, at least
  ``canary.min_effect``): enough requests per block and pairs for ``canary.power``, at least the pairs a sign-flip
  test needs to reach its level at all, at most what ``canary.max_window`` holds (the log then states the power
  left). As pairs come in, the plan grows when their differences spread more than it assumed: the sizing reads
  their squares only, which do not depend on the signs, so the test stays exact. A large gain spreads them too
  (a square holds the gain as well as the noise), which is why the planned pairs get a look of their own.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
from scipy import stats

from policies.control import KEEP_LOOKS, KEEP_ROUTES, Canary, min_pairs
from tuner.measure.statistics import Interval, proportion_difference_interval

# Requests that queue behind one burst attain or miss together: a block's share varies more than a binomial one.
# The sizing inflates the binomial variance by this design effect (the test itself needs no such assumption).
DESIGN_EFFECT = 2.0
EXACT_FLIPS = 16  # up to this many pairs the sign-flip distribution is enumerated; beyond it, sampled
SAMPLED_FLIPS = 20000
MIN_FOR_ROLLBACK = 5  # judged candidate requests before the rollback rule looks
ARMS = ("applied", "candidate")
NORMAL = NormalDist()


@dataclass(frozen=True)
class SwitchbackPlan:
    pairs: int  # planned; more when the differences spread more than assumed (pairs_needed), at most most_pairs
    most_pairs: int
    block_s: float
    settle_s: float
    candidate_first: tuple[bool, ...]  # per pair (most_pairs of them): the candidate takes the pair's first block
    effect: float  # the attainment gain the plan is sized to detect
    power: float  # the power at that gain with ``pairs`` pairs (below canary.power when max_window capped it)
    baseline: float  # the applied config's attainment the sizing assumed
    rate: float  # requests/s the sizing assumed (over the fleet)
    # one engine; or on a fleet the replicas that trade the candidate, the first ``group`` of them one group
    replicas: tuple[int, ...] = (0,)
    lease_margin: float = 30.0
    group: int = 1  # replicas per group on a fleet

    @property
    def seconds(self) -> float:
        return 2 * self.pairs * self.block_s

    @property
    def lease_s(self) -> float:
        """The candidate's lease from its PATCH: it may run two blocks in a row (a pair's second and the next
        pair's first), then the margin."""
        return 2 * self.block_s + self.lease_margin

    def arm(self, block: int) -> str:
        """Which config block ``block`` (0-based) runs (on a fleet: on the first of the two replicas)."""
        first = self.candidate_first[block // 2]
        return "candidate" if first == (block % 2 == 0) else "applied"

    def assignment(self, block: int) -> dict[int, str]:
        """Replica -> the config it runs in block ``block``: one engine takes turns; of a fleet's two groups one
        runs the candidate while the other runs the applied config, and they trade within each pair."""
        arm = self.arm(block)
        other = "applied" if arm == "candidate" else "candidate"
        return {r: arm if i < self.group else other for i, r in enumerate(self.replicas)}

    def as_dict(self) -> dict[str, Any]:
        return {"pairs": self.pairs, "most_pairs": self.most_pairs, "block_s": self.block_s, "settle_s": self.settle_s,
                "candidate_first": list(self.candidate_first),
                "effect": round(self.effect, 4), "power": round(self.power, 4), "baseline": round(self.baseline, 4),
                "rate": round(self.rate, 4), "replicas": list(self.replicas), "group": self.group,
                "lease_s": self.lease_s}


def pair_variance(baseline: float, effect: float, per_block: float) -> float:
    """The variance of one pair's difference of shares, each block holding ``per_block`` requests."""
    p = min(max(baseline, 0.02), 0.98)
    q = min(max(p + effect, 0.02), 0.98)
    return DESIGN_EFFECT * (p * (1 - p) + q * (1 - q)) / max(per_block, 1.0)


def z_sum(spec: Canary) -> float:
    return NORMAL.inv_cdf(1 - spec.level / KEEP_ROUTES) + NORMAL.inv_cdf(spec.power)


def power_of(pairs: int, effect: float, variance: float, level: float) -> float:
    """The normal approximation of the one-sided test's power with ``pairs`` pairs."""
    if pairs < 1:
        return 0.0
    z = effect / math.sqrt(variance / pairs)
    return NORMAL.cdf(z - NORMAL.inv_cdf(1 - level))


def settle_time(spec: Canary, service_s: float) -> float:
    """The unmeasured start of a block: ``canary.settle``, or longer when a request runs longer than that from its
    first token to its last (``service_s``, the longer of the two configs'): until then the block's finishes are
    mostly requests the config before admitted."""
    return max(spec.settle, service_s) if math.isfinite(service_s) else spec.settle


def service_pairs(spec: Canary, rate: float, service_gain: float, measured_s: float, fleet: int,
                  group: int = 1) -> int:
    """The pairs the service route needs for ``spec.power`` to detect ``service_gain`` more requests finished per
    second, each block's finishes counted over ``measured_s`` seconds (about Poisson, inflated by the design
    effect: requests admitted together finish together); 0 without a predicted gain."""
    if not (math.isfinite(service_gain) and service_gain > 0 and math.isfinite(rate) and measured_s > 0):
        return 0
    variance = DESIGN_EFFECT * (2 * rate / fleet + service_gain) / measured_s * concurrent(fleet, group)
    return math.ceil(z_sum(spec) ** 2 * variance / service_gain ** 2)


def concurrent(fleet: int, group: int) -> float:
    """How much a pair's variance shrinks on a fleet: its difference averages the two blocks' concurrent differences,
    each between two groups of ``group`` replicas (1.0 on one engine)."""
    return 0.5 / group if fleet > 1 else 1.0


def plan_switchback(spec: Canary, rate: float, baseline: float, predicted_gain: float, seed: int,
                    fleet: int = 1, service_s: float = math.nan, service_gain: float = math.nan) -> SwitchbackPlan:
    """Pairs for ``spec.power`` to detect the larger of the predicted gain and ``spec.min_effect`` at ``rate``
    requests/s from a baseline attainment ``baseline``; the order within each pair from ``seed``. On a ``fleet`` of
    replicas sharing the traffic, two groups of ``canary.share`` of them (drawn from ``seed``) trade the candidate:
    each block measures both configs at once, on each replica's share of the rate. A block measures
    ``canary.block - canary.settle`` seconds after its settling time (:func:`settle_time`). Behind a queue
    (``service_gain``: the requests/s more the candidate is predicted to finish) the plan holds the pairs the service
    route needs too."""
    baseline = baseline if math.isfinite(baseline) else 0.5  # a window with no finished request: the widest share
    effect = max(spec.min_effect, min(predicted_gain if math.isfinite(predicted_gain) else 0.0, 1.0 - baseline))
    settle = settle_time(spec, service_s)
    block = settle + spec.block - spec.settle
    group = max(1, int(spec.share * fleet + 1e-9)) if fleet > 1 else 1
    per_block = (rate if math.isfinite(rate) else 0.0) / fleet * (block - settle)
    variance = pair_variance(baseline, effect, per_block) * concurrent(fleet, group)
    wanted = max(math.ceil(z_sum(spec) ** 2 * variance / (effect * effect)),
                 service_pairs(spec, rate, service_gain, block - settle, fleet, group))
    most = int(spec.max_window // (2 * block))
    # at least the pairs whose look can keep at its share of the level should the plan grow (one pair more than a
    # single look needs), at most what max_window holds
    pairs = min(max(wanted, min_pairs(spec.level / KEEP_LOOKS)), most)
    order = random.Random(seed)
    replicas = tuple(order.sample(range(fleet), 2 * group)) if fleet > 1 else (0,)
    return SwitchbackPlan(pairs, most, block, settle, tuple(order.random() < 0.5 for _ in range(most)),
                          effect, power_of(pairs, effect, variance, spec.level / KEEP_ROUTES), baseline, rate,
                          replicas, spec.lease_margin, group)


def pairs_needed(differences: Sequence[float], plan: SwitchbackPlan, spec: Canary) -> int:
    """The plan's pairs, grown to what the differences' mean square (a variance that ignores their signs) asks for
    the planned effect and power, at most ``plan.most_pairs``."""
    if len(differences) < 2:
        return plan.pairs
    square = float(np.mean(np.square(differences)))
    return min(plan.most_pairs, max(plan.pairs, math.ceil(z_sum(spec) ** 2 * square / plan.effect ** 2)))


@dataclass(frozen=True)
class Block:
    """What one block's measured part saw."""

    index: int
    arm: str  # the config its replica ran
    attaining: int
    judged: int  # the requests its share is of: those that finished, or those that arrived when its queue grew
    finished: int
    arrived: int
    generation: int
    replica: int = 0
    seconds: float = 0.0  # the measured part's length
    backlogged: bool = False  # requests waited in the engine at both ends of the measured part

    @property
    def share(self) -> float:
        return self.attaining / self.judged if self.judged else math.nan

    @property
    def service(self) -> float:
        """Requests finished per second: while backlogged, the config's service rate."""
        return self.finished / self.seconds if self.seconds > 0 else math.nan

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "arm": self.arm, "attaining": self.attaining, "judged": self.judged,
                "finished": self.finished, "arrived": self.arrived, "generation": self.generation, "replica": self.replica,
                "seconds": round(self.seconds, 3), "backlogged": self.backlogged}


@functools.lru_cache(maxsize=EXACT_FLIPS)
def all_signs(n: int) -> np.ndarray:
    """Every pattern of n signs, one per row."""
    return np.array(list(itertools.product((1.0, -1.0), repeat=n)))


def sign_flip_p_value(differences: Sequence[float], seed: int = 0) -> float:
    """One-sided p-value of the mean of ``differences`` under random signs (each pair's order a fair coin):
    the share of sign patterns whose sum is at least the observed one."""
    d = np.asarray(differences, dtype=float)
    if d.size == 0:
        return 1.0
    observed = d.sum() - 1e-12
    if d.size <= EXACT_FLIPS:
        signs = all_signs(d.size)
    else:
        signs = np.random.default_rng(seed).choice((1.0, -1.0), size=(SAMPLED_FLIPS, d.size))
        signs[0] = 1.0  # the observed pattern is one of them
    return float(np.mean(signs @ d >= observed))


def pair_differences(blocks: Sequence[Block], figure: str = "share") -> tuple[float, ...]:
    """Of each complete pair (both its blocks measured, every measured part with requests): the candidate's mean
    ``figure`` (``share``: attainment; ``service``: requests finished per second) minus the applied config's (on a
    fleet, the mean over each group's replicas and the pair's two blocks)."""
    by_pair: dict[int, list[Block]] = {}
    for b in blocks:
        by_pair.setdefault(b.index // 2, []).append(b)
    out = []
    for pair in sorted(by_pair):
        mine = by_pair[pair]
        values = {arm: [getattr(b, figure) for b in mine if b.arm == arm] for arm in ARMS}
        if {b.index % 2 for b in mine} == {0, 1} and all(b.judged for b in mine) and all(values.values()):
            out.append(float(np.mean(values["candidate"]) - np.mean(values["applied"])))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def t_quantile(q: float, df: int) -> float:
    return float(stats.t.ppf(q, df))


def mean_interval(d: Sequence[float], level: float) -> Interval:
    """The pairs' mean difference with its t interval (two-sided at 1 - 2 level)."""
    if len(d) < 2:
        value = d[0] if d else math.nan
        return Interval(value, -1.0, 1.0, 1 - 2 * level, len(d))
    mean, sem = float(np.mean(d)), float(np.std(d, ddof=1) / math.sqrt(len(d)))
    half = t_quantile(1 - level, len(d) - 1) * sem
    return Interval(mean, max(-1.0, mean - half), min(1.0, mean + half), 1 - 2 * level, len(d))


@dataclass(frozen=True)
class CanaryVerdict:
    action: str  # "continue" | "keep" | "rollback" | "abandon" (the measuring failed: back to the kept config)
    reason: str
    difference: Interval  # candidate - applied attainment

    def as_dict(self) -> dict[str, Any]:
        return {"action": self.action, "reason": self.reason, "difference": self.difference.as_dict()}


def pooled(blocks: Sequence[Block], arm: str) -> tuple[int, int]:
    mine = [b for b in blocks if b.arm == arm]
    return sum(b.attaining for b in mine), sum(b.judged for b in mine)


def judge_switchback(blocks: Sequence[Block], plan: SwitchbackPlan, spec: Canary,
                     before: tuple[int, int] | None = None) -> CanaryVerdict:
    """The verdict after the measured ``blocks`` so far. The rollback rule compares the candidate's blocks with the
    applied config's and with ``before`` (attaining, judged: the window before the canary): a config that breaks
    the SLO leaves a queue the applied config's next block serves, so the blocks alone understate the harm, and a
    rollback never keeps, so a comparison with the window that fired the trigger costs the false-keep rate
    nothing."""
    candidate = pooled(blocks, "candidate")
    for applied in (pooled(blocks, "applied"), before):
        if applied is None or not applied[1] or candidate[1] < MIN_FOR_ROLLBACK:
            continue
        drop = proportion_difference_interval(*candidate, *applied)
        if drop.high < -spec.rollback_drop:
            return CanaryVerdict("rollback", f"the SLO broke: attainment fell by "
                                             f"{drop.format(scale=100, unit=' pp')}, more than canary.rollback_drop "
                                             f"({spec.rollback_drop:.0%}) beyond the noise", drop)
    d = pair_differences(blocks)
    done = len({b.index for b in blocks})
    mean = mean_interval(d, spec.level)
    shown = f"{mean.format(scale=100, unit=' pp')} over {len(d)} pairs"
    # Where the planned pairs' differences spread more than the plan assumed, it grows, and the keep tests look
    # twice (at the planned pairs and at the end), each at half the level: a candidate whose large gain spreads its
    # differences (their squares hold the gain too) is kept at the plan instead of running to max_window. Whether
    # it grows is read from the planned pairs' squares alone, which do not depend on the signs and are fixed once
    # the plan is in, so under "no difference" the looks together keep at most at the level.
    grown = done >= 2 * plan.pairs and pairs_needed(d[:plan.pairs], plan, spec) > plan.pairs
    needed = pairs_needed(d, plan, spec) if grown else plan.pairs
    at_plan = grown and done == 2 * plan.pairs
    if done < 2 * needed and not at_plan:
        return CanaryVerdict("continue", f"{done} of {2 * max(needed, plan.pairs)} blocks, difference {shown}", mean)
    level = spec.level / KEEP_ROUTES / (KEEP_LOOKS if grown else 1)
    p_value = sign_flip_p_value(d)
    if p_value <= level:
        return CanaryVerdict("keep", f"better than the applied config in the same traffic: attainment {shown}, "
                                     f"sign-flip p = {p_value:.3g} <= {level:g} (canary.level over its routes and "
                                     "looks)", mean)
    faster = drains(blocks, level)
    if faster is not None:
        return CanaryVerdict("keep", faster, mean)
    if at_plan:
        return CanaryVerdict("continue", f"{done} of {2 * needed} blocks (the differences spread more than planned), "
                                         f"difference {shown}, sign-flip p = {p_value:.3g} > {level:g}", mean)
    return CanaryVerdict("rollback", f"no gain shown over {len(d)} pairs (sized for +{plan.effect:.0%}): attainment "
                                     f"{shown}, sign-flip p = {p_value:.3g} > {level:g}; no faster service shown "
                                     "while backlogged", mean)


def drains(blocks: Sequence[Block], level: float) -> str | None:
    """The second route: behind a backlog (requests waiting at both ends of a measured part) no config attains, and
    the one that finishes more requests per second drains the queue. Why it is kept, when its service rate over all
    the pairs is higher by the sign-flip test at ``level`` and its attainment no lower; else None. (The pairs a
    candidate emptied the queue in count too: they are where it shows. Whether any block waited does not depend
    on which config ran it when the configs make no difference, so the test stays exact.)"""
    if not any(b.backlogged for b in blocks):
        return None
    d = pair_differences(blocks, "service")
    p_value = sign_flip_p_value(d)
    candidate, applied = pooled(blocks, "candidate"), pooled(blocks, "applied")
    no_lower = candidate[0] * applied[1] >= applied[0] * candidate[1]
    if p_value > level or not no_lower:
        return None
    mean = mean_interval(d, level)
    return (f"drains the backlog faster than the applied config: {mean.format(unit=' req/s')} more finished per "
            f"second over {len(d)} pairs, sign-flip p = {p_value:.3g} <= {level:g}, attainment no lower")
