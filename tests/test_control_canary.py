"""The canary's switchback, simulated with the project's own plan and verdict on traffic like the real: requests
per block from Poisson arrivals, a block's attainment that wanders over time (an autocorrelated process: bursts
make a block's requests miss together, and the trigger fires at a trough), judged at every block as the controller
does. A candidate no better than the applied config is kept at most at ``canary.level``; a 10-point gain is kept
at the power the plan states."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from policies.control import Canary, min_pairs
from tuner.control.canary import Block, judge_switchback, plan_switchback, sign_flip_p_value
from tuner.control.canary_run import judged_block
from tuner.control.window import WindowStats
from tuner.measure.statistics import proportion_interval

SPEC = Canary()
TARGET = 0.9


class Traffic:
    """A block's true attainment: logit(base) plus an AR(1) wander (phi per block), and its requests Poisson."""

    def __init__(self, rng: np.random.Generator, rate: float, base: float, phi: float = 0.8, sigma: float = 0.35):
        self.rng, self.rate, self.base, self.phi, self.sigma = rng, rate, base, phi, sigma
        self.x = rng.normal(0.0, sigma / math.sqrt(1 - phi * phi))

    def step(self, gain: float = 0.0) -> tuple[int, int]:
        """(attaining, requests) of the next block's measured part; ``gain`` added to its share."""
        self.x = self.phi * self.x + self.rng.normal(0.0, self.sigma)
        p = 1 / (1 + math.exp(-(math.log(self.base / (1 - self.base)) + self.x)))
        n = int(self.rng.poisson(self.rate * (SPEC.block - SPEC.settle)))
        return int(self.rng.binomial(n, min(0.999, max(0.001, p + gain)))), n


def after_trigger(traffic: Traffic) -> tuple[int, int]:
    """Run the traffic until a 60 s trigger window (three blocks) misses the target beyond the noise, as the
    attainment trigger fires; that window's (attaining, requests)."""
    window: list[tuple[int, int]] = []
    while True:
        window = (window + [traffic.step()])[-3:]
        k, n = sum(w[0] for w in window), sum(w[1] for w in window)
        if len(window) == 3 and n >= 20 and proportion_interval(k, n).high < TARGET:
            return k, n


def canary(traffic: Traffic, gain: float, seed: int, before: tuple[int, int] | None) -> str:
    """One canary, judged at every block: its outcome."""
    baseline = before[0] / before[1] if before else traffic.base
    plan = plan_switchback(SPEC, traffic.rate, baseline, 0.0, seed)
    blocks: list[Block] = []
    for i in range(2 * plan.most_pairs):
        arm = plan.arm(i)
        k, n = traffic.step(gain if arm == "candidate" else 0.0)
        blocks.append(Block(i, arm, k, n, n, n, 1))
        verdict = judge_switchback(blocks, plan, SPEC, before)
        if verdict.action != "continue":
            return verdict.action
    raise AssertionError("the canary outlived its longest window")


def keep_rate(rate: float, gain: float, draws: int, trigger: bool, seed: int, base: float = 0.88) -> float:
    rng = np.random.default_rng(seed)
    keeps = 0
    for i in range(draws):
        traffic = Traffic(rng, rate, base)
        before = after_trigger(traffic) if trigger else None
        keeps += canary(traffic, gain, seed * 100_000 + i, before) == "keep"
    return keeps / draws


def at_most(observed: float, level: float, draws: int) -> bool:
    """The observed rate is consistent with a true rate at or below ``level`` (one-sided binomial test at 1 %)."""
    return stats.binomtest(round(observed * draws), draws, level, alternative="greater").pvalue > 0.01


def test_a_no_better_candidate_is_kept_at_most_at_the_level_after_an_attainment_trigger() -> None:
    """The window that fired the trigger was chosen for being bad; the before/after compare kept a no-better
    candidate 40 % of the time after it. The switchback never compares with that window."""
    draws = 300
    assert at_most(keep_rate(1.6, 0.0, draws, trigger=True, seed=1), SPEC.level, draws)


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.4, 1.6])
@pytest.mark.parametrize("trigger", [True, False])
def test_the_false_keep_rate_holds_at_the_benchmark_rates(rate: float, trigger: bool) -> None:
    draws = 2000
    assert at_most(keep_rate(rate, 0.0, draws, trigger, seed=2), SPEC.level, draws)


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.4, 1.6])
def test_a_ten_point_gain_is_kept_at_the_power_the_plan_states(rate: float) -> None:
    draws = 600
    stated = plan_switchback(SPEC, rate, 0.8, 0.0, 0).power
    kept = keep_rate(rate, 0.10, draws, trigger=False, seed=3, base=0.8)
    # the plan's power is a normal approximation with a fixed design effect: it may understate, not overstate
    assert kept >= stated - 3 * math.sqrt(stated * (1 - stated) / draws), (kept, stated)


def test_the_plan_states_the_power_left_when_max_window_caps_it() -> None:
    slow, fast = plan_switchback(SPEC, 0.4, 0.8, 0.0, 0), plan_switchback(SPEC, 8.0, 0.8, 0.0, 0)
    assert slow.pairs == slow.most_pairs == int(SPEC.max_window // (2 * SPEC.block)) and slow.power < SPEC.power
    # eight pairs at 0.025: one more than a single look needs, so that a look at the plan can keep too
    assert fast.pairs == min_pairs(SPEC.level / 2) == min_pairs(SPEC.level) + 1 and fast.power >= SPEC.power
    assert plan_switchback(SPEC, 0.4, 0.8, 0.4, 0).pairs < slow.pairs  # a larger predicted gain needs fewer pairs
    assert sum(slow.candidate_first) not in (0, slow.most_pairs)  # the order is drawn per pair


def test_the_sign_flip_test_is_exact_and_needs_enough_pairs() -> None:
    assert sign_flip_p_value([0.1] * 5) == 2 ** -5 > SPEC.level  # five pairs can never reach 2.5 %
    assert sign_flip_p_value([0.1] * 6) == 2 ** -6 <= SPEC.level
    assert sign_flip_p_value([0.1, -0.1]) == 0.75
    assert 0.0 < sign_flip_p_value([0.05] * 20) < 1e-3  # beyond the enumerated size: sampled, never 0


def test_a_broken_candidate_is_rolled_back_at_its_first_block() -> None:
    plan = plan_switchback(SPEC, 2.0, 0.95, 0.0, 7)
    first = [Block(0, plan.arm(0), 2 if plan.arm(0) == "candidate" else 28, 30, 30, 30, 1)]
    verdict = judge_switchback(first, plan, SPEC, before=(57, 60))
    assert verdict.action == "rollback" and "SLO broke" in verdict.reason


def test_a_block_whose_queue_grew_counts_the_requests_it_left_waiting() -> None:
    grew = WindowStats(0.0, 15.0, 10, 25, 9, 0.05, 0, 0, 0, 0, (3, 3), missed_tbt=1)
    assert judged_block(0, "applied", grew, 3).share == pytest.approx(9 / 25)
    assert judged_block(1, "candidate", None, 4).judged == 0


def backlogged_canary(rng: np.random.Generator, applied_rate: float, candidate_rate: float, seed: int) -> str:
    """A canary behind a queue no config attains in: each block finishes Poisson(rate x 15 s) requests, none of
    them within the SLO."""
    plan = plan_switchback(SPEC, 2.0, 0.0, 0.0, seed)
    blocks: list[Block] = []
    for i in range(2 * plan.most_pairs):
        arm = plan.arm(i)
        n = int(rng.poisson((candidate_rate if arm == "candidate" else applied_rate) * 15.0))
        blocks.append(Block(i, arm, 0, max(n, 1), n, n, 1, 0, 15.0, backlogged=True))
        verdict = judge_switchback(blocks, plan, SPEC)
        if verdict.action != "continue":
            return verdict.action + (" drains" if "drains" in verdict.reason else "")
    raise AssertionError("the canary outlived its longest window")


def test_behind_a_backlog_a_config_that_finishes_more_is_kept_and_one_no_faster_at_half_the_level() -> None:
    """The old compare kept a canary that drained a queue; the switchback's second route does it by a sign-flip
    test of the requests finished per second, at half the canary's level (the other half is attainment's)."""
    rng = np.random.default_rng(31)
    draws = 400
    same = sum(backlogged_canary(rng, 1.0, 1.0, i) == "keep drains" for i in range(draws))
    assert at_most(same / draws, SPEC.level / 2, draws)
    faster = sum(backlogged_canary(rng, 1.0, 2.0, i) == "keep drains" for i in range(60))  # twice as fast
    assert faster >= 50


def test_a_block_settles_for_as_long_as_a_request_runs_and_the_lease_covers_two_blocks() -> None:
    spec = Canary(block=20.0, settle=5.0, max_window=600.0, lease_margin=30.0)
    quick = plan_switchback(spec, 1.0, 0.8, 0.1, seed=1, service_s=2.0)
    slow = plan_switchback(spec, 1.0, 0.8, 0.1, seed=1, service_s=12.0)
    assert (quick.settle_s, quick.block_s, quick.lease_s) == (5.0, 20.0, 70.0)
    # requests that run 12 s: 12 s unmeasured, then the same 15 s measured; fewer pairs fit the longest window
    assert (slow.settle_s, slow.block_s, slow.lease_s) == (12.0, 27.0, 84.0)
    assert slow.most_pairs == int(600 // 54) < quick.most_pairs
    # the window's own service time: its outputs' mean times the mean gap between tokens
    stats_ = WindowStats(0.0, 15.0, 4, 4, 4, 0.05, 0, 200, 0, 0, (1, 1), mean_gap=0.08)
    assert stats_.service_s == pytest.approx(50 * 0.08)


def queue_canary(rng: np.random.Generator, spec: Canary, gain: float, seed: int) -> tuple[str, int]:
    """A canary planned behind a queue for 0.3 req/s more finished: each block finishes Poisson((1 + gain if the
    candidate) x 15 s) requests, none within the SLO; a candidate's block empties the queue half the time (not
    backlogged). Its outcome and the blocks it took."""
    plan = plan_switchback(spec, 1.0, 0.0, 0.0, seed, service_gain=0.3)
    blocks: list[Block] = []
    for i in range(2 * plan.most_pairs):
        arm = plan.arm(i)
        n = int(rng.poisson((1.0 + (gain if arm == "candidate" else 0.0)) * 15.0))
        waited = arm == "applied" or rng.random() < 0.5
        blocks.append(Block(i, arm, 0, max(n, 1), n, n, 1, 0, 15.0, backlogged=waited))
        verdict = judge_switchback(blocks, plan, spec)
        if verdict.action != "continue":
            return verdict.action + (" drains" if "drains" in verdict.reason else ""), i + 1
    raise AssertionError("the canary outlived its longest window")


def test_behind_a_queue_the_plan_holds_the_pairs_the_service_route_needs() -> None:
    """Behind a queue no block attains, so only the service route can keep; the plan is sized for it, and the
    blocks a candidate emptied the queue in count (they are where it shows)."""
    spec = Canary(block=20.0, settle=5.0, level=0.05, max_window=3600.0)
    assert plan_switchback(spec, 1.0, 0.0, 0.0, 3, service_gain=0.3).pairs > plan_switchback(spec, 1.0, 0.0, 0.0, 3).pairs
    rng = np.random.default_rng(17)
    draws = 300
    kept = [queue_canary(rng, spec, 0.3, i) for i in range(draws)]
    planned = plan_switchback(spec, 1.0, 0.0, 0.0, 0, service_gain=0.3).pairs
    # the plan's power (0.8) at the gain it was sized for, with the design effect's room to spare
    assert sum(k == "keep drains" and blocks <= 2 * planned for k, blocks in kept) >= 0.8 * draws
    same = sum(queue_canary(rng, spec, 0.0, i)[0] == "keep drains" for i in range(draws))
    assert at_most(same / draws, spec.level / 2, draws)


def test_a_large_gain_is_kept_at_the_planned_pairs_not_at_the_longest_window() -> None:
    """A gain far above the planned effect spreads the pairs' differences (their squares hold the gain), so the plan
    grows; the look at the planned pairs keeps it there instead of running to max_window."""
    rng = np.random.default_rng(23)
    at_plan = 0
    draws = 100
    for i in range(draws):
        traffic = Traffic(rng, 1.0, 0.5)
        plan = plan_switchback(SPEC, 1.0, 0.5, 0.3, i)  # sized for +30 points
        blocks: list[Block] = []
        for b in range(2 * plan.most_pairs):
            arm = plan.arm(b)
            k, n = traffic.step(0.45 if arm == "candidate" else 0.0)
            blocks.append(Block(b, arm, k, n, n, n, 1))
            verdict = judge_switchback(blocks, plan, SPEC)
            if verdict.action != "continue":
                at_plan += verdict.action == "keep" and b + 1 == 2 * plan.pairs
                break
    assert at_plan >= 0.8 * draws


def fleet_canary(rng: np.random.Generator, replicas: int, rate: float, gain: float, seed: int,
                 spec: Canary = SPEC) -> str:
    """One canary on a fleet whose replicas share the traffic's wander (bursts reach all of them) but differ in
    their own attainment (one replica on a slower host), judged at every block: its outcome."""
    plan = plan_switchback(spec, rate, 0.78, 0.0, seed, fleet=replicas)
    # bases low enough that a 10-point gain is not clipped at 100 % on any replica
    traffic = [Traffic(rng, rate / replicas, base) for base in np.linspace(0.72, 0.84, replicas)]
    blocks: list[Block] = []
    for i in range(2 * plan.most_pairs):
        common = rng.normal(0.0, 0.05)  # a burst every replica sees in this block
        for r, arm in plan.assignment(i).items():
            k, n = traffic[r].step((gain if arm == "candidate" else 0.0) + common)
            blocks.append(Block(i, arm, k, n, n, n, 1, r))
        verdict = judge_switchback(blocks, plan, spec)
        if verdict.action != "continue":
            return verdict.action
    raise AssertionError("the canary outlived its longest window")


def test_on_a_fleet_a_share_of_the_replicas_runs_the_candidate_and_as_many_its_control() -> None:
    two = plan_switchback(SPEC, 2.0, 0.85, 0.0, seed=4, fleet=2)
    assert sorted(two.replicas) == [0, 1] and two.group == 1
    four = plan_switchback(SPEC, 2.0, 0.85, 0.0, seed=4, fleet=4)
    assert sorted(four.replicas) == [0, 1, 2, 3] and four.group == 2
    for block in range(2 * four.pairs):
        arms = four.assignment(block)
        assert sorted(arms.values()) == ["applied", "applied", "candidate", "candidate"]
        # the groups trade within each pair: every replica runs each config once a pair
        other = four.assignment(block ^ 1)
        assert all(other[r] != arm for r, arm in arms.items())
    five = plan_switchback(SPEC, 2.0, 0.85, 0.0, seed=4, fleet=5)
    assert len(five.replicas) == 4 and five.group == 2  # one replica keeps the applied config, unmeasured
    eighth = plan_switchback(Canary(share=0.125), 2.0, 0.85, 0.0, seed=4, fleet=8)
    assert len(eighth.replicas) == 2 and eighth.group == 1
    # more replicas measured in each block: fewer pairs for the same power
    assert four.pairs <= two.pairs and four.as_dict()["group"] == 2


def test_on_a_fleet_of_four_a_no_better_candidate_is_kept_at_most_at_the_level() -> None:
    rng = np.random.default_rng(11)
    draws = 300
    kept = sum(fleet_canary(rng, 4, 4.0, 0.0, 7_000 + i) == "keep" for i in range(draws)) / draws
    assert at_most(kept, SPEC.level, draws)


@pytest.mark.slow
def test_on_a_fleet_of_four_a_ten_point_gain_is_kept_at_the_power_the_plan_states() -> None:
    rng = np.random.default_rng(12)
    draws = 400
    stated = plan_switchback(SPEC, 1.6, 0.78, 0.0, 0, fleet=4).power
    kept = sum(fleet_canary(rng, 4, 1.6, 0.10, 8_000 + i) == "keep" for i in range(draws)) / draws
    assert kept >= stated - 3 * math.sqrt(stated * (1 - stated) / draws), (kept, stated)
