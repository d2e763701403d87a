"""The verdict's mechanics on scripted measurements with known answers: what it measures where, on which draws, how it
pairs the configs, when it stops, and what it claims. Its error rates are in tests/test_statistical_levels.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tuner.measure.dependence import block_counts
from tuner.measure.capacity import Ratio
from tuner.measure.verdict import RATES_PER_CANDIDATE, Contender, Sample, VerdictResult, pool_levels
from tuner.measure.verdict_report import verdict_line
from tuner.measure.verdict_rounds import first_rate, paired_verdict


def blocks(attaining: int, requests: int, size: int = 10) -> tuple[tuple[int, int], ...]:
    """``requests`` requests in blocks of ``size``, the misses spread evenly over them."""
    y = np.ones(requests, dtype=bool)
    misses = requests - attaining
    y[np.linspace(0, requests - 1, misses).round().astype(int) if misses else []] = False
    return tuple(block_counts(y, size))


def fixed_world(shares: dict[str, dict[float, float]], requests: int = 600) -> tuple[list[tuple[str, float, int]], object]:
    """measure_at from each config's share per rate (misses spread over the blocks); records every call."""
    seen: list[tuple[str, float, int]] = []

    def measure_at(c: Contender, rate: float, draw: int) -> Sample:
        seen.append((c.name, round(rate, 6), draw))
        share = shares[c.name].get(round(rate, 6), shares[c.name].get(-1.0, 1.0))
        return Sample(rate, draw, blocks(int(round(share * requests)), requests))
    return seen, measure_at


def test_better_needs_the_candidate_shown_served_at_a_rate_the_default_is_shown_to_miss() -> None:
    seen, measure_at = fixed_world({"default": {-1.0: 0.5}, "candidate 1": {-1.0: 1.0}})
    d = Contender("default", {}, 1.0, search_high=1.2)
    c = Contender("candidate 1", {}, 4.0, next_rate=4.0 / 1.15)
    r = paired_verdict(d, [c], measure_at, max_rounds=2, budget_s=math.inf, step=1.15)
    assert r.outcome(c) == "better" and r.winner is c and "shown better after 1 rounds" in r.stopped
    # round 1: the default beside the candidate on the same draw and at its own ceiling (a step above its search's
    # lowest rate that read below 90 %), the candidate at one step below its searched capacity
    assert sorted(seen) == sorted([("default", round(4.0 / 1.15, 6), 100), ("default", round(1.2 * 1.15, 6), 100),
                                   ("candidate 1", round(4.0 / 1.15, 6), 100)])
    ratio = r.ratio(c)
    assert ratio.low == pytest.approx((4.0 / 1.15) / (1.2 * 1.15)) and ratio.high is None  # from shown bounds
    diff = r.paired_difference(c, 4.0 / 1.15)
    assert diff is not None and diff.value == 0.5 and diff.low > 0.3
    line = verdict_line(r, "p99 TBT <= 50ms")
    assert line.startswith("tuned serves 3.48 req/s") and ">= 2.52x the default's capacity" in line
    assert "attains 100.0% against the default's 50.0%" in line


def test_a_default_never_shown_to_miss_gives_no_winner_and_no_multiple() -> None:
    """The candidate is shown to serve its rate, the default attains 89 % there (undecided with these requests):
    not "better", and the line says what was shown instead of a multiple."""
    _, measure_at = fixed_world({"default": {-1.0: 0.89}, "candidate 1": {-1.0: 1.0}})
    d = Contender("default", {}, 3.0, search_high=math.inf)
    c = Contender("candidate 1", {}, 4.0, next_rate=3.5)
    r = paired_verdict(d, [c], measure_at, max_rounds=2, budget_s=math.inf)
    assert r.outcome(c) == "undecided" and r.winner is None and r.safest is c
    assert r.ratio(c) == Ratio(None, None) and r.ratio(c).format() == "no multiple shown"
    line = verdict_line(r, "p99 TBT <= 50ms")
    assert line.startswith("no config was shown to serve more than the default") and "serves 3.5 req/s" in line
    assert "against the default's 89.0%" in line


def test_with_nothing_shown_served_the_candidate_shown_to_attain_more_is_written_without_a_capacity_claim() -> None:
    """Neither config shown to serve a rate (the candidate at 85 %, the default at 50 % on the same arrivals): the
    safest is the candidate whose gain on the same arrivals is shown, and the line says it is a choice, not a
    claim. A gain shown below zero, or a config shown to serve a rate, keeps the former rule."""
    def one_round(shares: dict[str, dict[float, float]],
                  search_high: float = math.inf) -> tuple[VerdictResult, Contender]:
        _, measure_at = fixed_world(shares)
        d = Contender("default", {}, 1.0, search_high=search_high)
        c = Contender("candidate 1", {}, 4.0, next_rate=3.5)
        return paired_verdict(d, [c], measure_at, max_rounds=1, budget_s=math.inf, step=1.15), c

    r, c = one_round({"default": {-1.0: 0.5}, "candidate 1": {-1.0: 0.85}})
    assert r.winner is None and c.shown().low == 0 and r.default.shown().low == 0
    assert r.shown_gain(c) is not None and r.shown_gain(c) > 0.2 and r.safest is c
    line = verdict_line(r, "p99 TBT <= 50ms")
    assert line.startswith("no config was shown to serve more than the default")
    assert "safest: candidate 1 (nothing shown served; it attains more than the default on the same arrivals: a " \
           "choice, not a capacity claim)" in line
    r, c = one_round({"default": {-1.0: 0.95}, "candidate 1": {-1.0: 0.85}})  # shown to attain less
    assert r.shown_gain(c) is None and r.safest is r.default
    # the default shown to serve its own ceiling: a rate shown served outranks a gain
    r, c = one_round({"default": {round(1.2 * 1.15, 6): 1.0, -1.0: 0.5}, "candidate 1": {-1.0: 0.85}}, 1.2)
    assert r.default.shown().low > 0 and r.safest is r.default


def test_a_claim_that_does_not_hold_on_fresh_draws_steps_down_once_and_no_further() -> None:
    shares = {"default": {-1.0: 0.3}, "candidate 1": {round(4.0, 6): 0.6, -1.0: 0.6}}
    seen, measure_at = fixed_world(shares)
    d = Contender("default", {}, 1.0, search_high=math.inf)
    c = Contender("candidate 1", {}, 4.0, next_rate=4.0)
    r = paired_verdict(d, [c], measure_at, max_rounds=4, budget_s=math.inf, step=1.15)
    rates = sorted({rate for name, rate, _ in seen if name == "candidate 1"}, reverse=True)
    assert len(rates) == RATES_PER_CANDIDATE and rates[1] < rates[0]  # its claims are spent on two rates at most
    assert r.outcome(c) == "undecided" and c.next_rate is None


def test_a_step_down_goes_no_lower_than_the_rate_where_the_default_is_shown_to_miss() -> None:
    """Once the default is shown to miss at its ceiling, the candidate need only serve that rate to be better: it
    steps down to it, but not below it."""
    shares = {"default": {-1.0: 0.2}, "candidate 1": {round(4.0, 6): 0.7, -1.0: 1.0}}
    seen, measure_at = fixed_world(shares)
    d = Contender("default", {}, 2.5, search_high=3.0)
    c = Contender("candidate 1", {}, 4.0, next_rate=4.0)
    r = paired_verdict(d, [c], measure_at, max_rounds=3, budget_s=math.inf, step=1.15)
    second = sorted({rate for name, rate, _ in seen if name == "candidate 1"})[0]
    assert second == round(max(3.0 * 1.15, 4.0 / 1.15 ** 2), 6)
    assert r.winner is c


def test_the_order_alternates_and_every_round_has_its_own_draw() -> None:
    seen, measure_at = fixed_world({"default": {-1.0: 0.89}, "candidate 1": {-1.0: 0.92}})
    d = Contender("default", {}, 1.0, search_high=math.inf)
    c = Contender("candidate 1", {}, 2.0, next_rate=2.0)
    paired_verdict(d, [c], measure_at, max_rounds=2, budget_s=math.inf, first_draw=7)
    assert [(n, dr) for n, _, dr in seen] == [("default", 7), ("candidate 1", 7), ("candidate 1", 8), ("default", 8)]


def test_the_verdict_stops_when_the_next_round_would_exceed_the_budget() -> None:
    t = [0.0]
    _, inner = fixed_world({"default": {-1.0: 0.89}, "candidate 1": {-1.0: 0.9}})

    def slow(c: Contender, rate: float, draw: int) -> Sample:
        t[0] += 50.0
        return inner(c, rate, draw)  # type: ignore[operator]

    d = Contender("default", {}, 2.0)
    c = Contender("candidate 1", {}, 2.0)
    r = paired_verdict(d, [c], slow, max_rounds=10, budget_s=150.0, clock=lambda: t[0])
    assert "time budget" in r.stopped and t[0] <= 150.0 + 100.0  # never a round started that could not fit


def test_a_round_that_does_not_fit_whole_steps_the_candidate_down_without_the_defaults_ceiling() -> None:
    """A candidate not shown at its first rate, the budget short of a whole second round (the default at its own
    ceiling, undecided with a miss within reach, included): the second round runs without that ceiling, which decides no candidate's outcome,
    and the candidate is shown better where it steps down. With a budget that holds the whole round, the ceiling is
    measured again. (On the engine, with the ceiling in every round, a run stopped after one round with five of
    its 22 minutes unused and wrote the default.)"""
    ceiling = round(1.54 * 1.15, 6)
    first = round(3.864, 6)
    second = round(math.sqrt(first * 1.54), 6)
    seconds = {"candidate": 180.0, "beside": 90.0, "ceiling": 60.0}

    def kind(c: Contender, rate: float) -> str:
        return "candidate" if not c.is_default else "ceiling" if round(rate, 6) == ceiling else "beside"

    def run(budget_s: float) -> tuple[list[tuple[str, float, int]], Contender, object]:
        t = [0.0]
        seen, inner = fixed_world({"default": {ceiling: 0.87, -1.0: 0.5},
                                   "candidate 1": {first: 0.8, second: 1.0, -1.0: 0.8}})

        def timed(c: Contender, rate: float, draw: int) -> Sample:
            t[0] += seconds[kind(c, rate)]
            return inner(c, rate, draw)  # type: ignore[operator]

        d = Contender("default", {}, 1.41, search_high=1.54)
        c = Contender("candidate 1", {}, 5.11, next_rate=first)
        r = paired_verdict(d, [c], timed, max_rounds=4, budget_s=budget_s, step=1.15, clock=lambda: t[0],
                           cost=lambda plan: sum(seconds[kind(c, rate)] for c, rate in plan))
        return seen, c, r

    seen, c, r = run(655.0)  # round 1 took 330 s: a whole second round (330 s) does not fit, one without it does
    assert sorted(x for x in seen if x[2] == 101) == [("candidate 1", second, 101), ("default", second, 101)]
    assert r.winner is c and c.shown().low == pytest.approx(second) and "shown better after 2 rounds" in r.stopped
    seen, c, r = run(700.0)
    assert ("default", ceiling, 101) in seen and r.winner is c


def test_a_void_measurement_is_no_evidence_and_a_failed_config_misses() -> None:
    def measure_at(c: Contender, rate: float, draw: int) -> Sample:
        if c.is_default:
            return Sample(rate, draw, (), void="load test failed: locust exited with 1")
        return Sample(rate, draw, (), failed="rejected by the engine: 422")

    d = Contender("default", {}, 2.0)
    c = Contender("candidate 1", {}, 2.0, next_rate=2.0)
    r = paired_verdict(d, [c], measure_at, max_rounds=1, budget_s=math.inf)
    assert d.pool(2.0) is not None and d.pool(2.0).verdict() == "undecided"  # type: ignore[union-attr]
    assert c.pool(2.0) is not None and c.pool(2.0).verdict() == "missed"  # type: ignore[union-attr]
    assert r.outcome(c) == "undecided"  # the default's void measurement showed nothing about it


def test_each_side_spends_half_the_error_rate_over_the_rates_it_may_be_judged_at() -> None:
    candidate, default = pool_levels(0.95, 1)
    assert candidate == 1 - 0.05 / RATES_PER_CANDIDATE and default == 1 - 0.05 / (RATES_PER_CANDIDATE + 1)
    assert pool_levels(0.95, 2)[0] == 1 - 0.05 / (2 * RATES_PER_CANDIDATE)


def test_the_verdict_record_names_pools_levels_outcomes_and_the_paired_difference() -> None:
    _, measure_at = fixed_world({"default": {-1.0: 0.5}, "candidate 1": {-1.0: 1.0}})
    d = Contender("default", {}, 1.0, search_high=1.2)
    c = Contender("candidate 1", {}, 4.0, next_rate=3.0)
    doc = paired_verdict(d, [c], measure_at, max_rounds=2, budget_s=math.inf).as_dict()
    cand = doc["candidates"][0]
    assert cand["outcome"] == "better" and cand["pools"] and cand["ratio_to_default"]["low"] is not None
    assert {"rate", "requests", "attaining", "attainment", "verdict", "samples"} <= set(cand["pools"][0])
    assert cand["pools"][0]["samples"][0]["blocks"]  # the evidence, block by block
    assert cand["paired_difference"]["3"]["low"] > 0
    assert doc["pool_level"] == {"candidates": pool_levels(0.95, 1)[0], "default": pool_levels(0.95, 1)[1]}


def test_served_and_missed_at_the_same_rate_decide_however_the_rate_was_computed() -> None:
    """The default measured beside the candidate at its rate (kept to nine decimals) and the candidate at the
    unrounded one: shown served there against shown missed there is better."""
    _, measure_at = fixed_world({"default": {-1.0: 0.5}, "candidate 1": {-1.0: 1.0}})
    d = Contender("default", {}, 1.0, search_high=math.inf)
    c = Contender("candidate 1", {}, 6.0, next_rate=6.0 / 1.15 ** 2)
    r = paired_verdict(d, [c], measure_at, max_rounds=1, budget_s=math.inf)
    assert r.winner is c and r.ratio(c).format() == "> 1x"


def test_a_candidate_not_shown_near_its_knee_steps_to_the_middle_toward_the_defaults_ceiling() -> None:
    """A candidate at 93 % at its first rate, its next round unable to show it served, attains 95 % a step lower (too
    few blocks to show it). With the default's searched ceiling far below, the second rate is the geometric middle
    of the first and that ceiling, where the candidate attains all its requests and is shown to serve a rate the
    default misses: a one-step rule leaves it undecided and the default config would be written. The default is not
    yet shown to miss below the candidate's first rate, so only the searched ceiling can place the step."""
    shares = {"default": {round(1.5 * 1.15, 6): 0.89, -1.0: 0.5},  # undecided at its own ceiling, near its knee
              "candidate 1": {round(4.0, 6): 0.93, round(4.0 / 1.15, 6): 0.95, -1.0: 1.0}}
    seen, measure_at = fixed_world(shares)
    d = Contender("default", {}, 1.2, search_high=1.5)
    c = Contender("candidate 1", {}, 4.6, next_rate=4.0)
    r = paired_verdict(d, [c], measure_at, max_rounds=2, budget_s=math.inf, step=1.15)
    rates = sorted({rate for name, rate, _ in seen if name == "candidate 1"}, reverse=True)
    assert rates == [4.0, round(math.sqrt(4.0 * 1.5), 6)]
    assert r.winner is c and r.outcome(c) == "better"


def test_a_candidate_not_shown_goes_straight_to_the_rate_the_default_is_shown_to_miss() -> None:
    """A candidate whose sustained knee lies far below its searched capacity (88-91 % at its first rate and two
    steps lower) is never shown served near it; once the default is shown to miss at its own ceiling, the
    candidate's second rate is that ceiling, however far below, where it serves and is shown better."""
    ceiling = round(1.5 * 1.15, 6)
    shares = {"default": {-1.0: 0.5}, "candidate 1": {round(7.0, 6): 0.90, ceiling: 1.0, -1.0: 0.88}}
    seen, measure_at = fixed_world(shares)
    d = Contender("default", {}, 1.3, search_high=1.5)
    c = Contender("candidate 1", {}, 9.0, next_rate=7.0)
    r = paired_verdict(d, [c], measure_at, max_rounds=2, budget_s=math.inf, step=1.15)
    rates = sorted({rate for name, rate, _ in seen if name == "candidate 1"}, reverse=True)
    assert rates == [7.0, ceiling]  # not 7.0 / 1.15 ** 2, where it attains 88 %
    assert r.winner is c and r.ratio(c).low == pytest.approx(1.0)


def test_a_winner_shown_at_the_defaults_missed_rate_climbs_toward_its_knee_while_rounds_are_left() -> None:
    """Shown better at the rate where the default misses (far below its knee), the winner climbs: each climb the
    geometric middle of its highest rate shown served and the lowest above it not shown served, each started once
    the one below was shown served. Its shown capacity rises from 1.73 to 4.93 req/s; the headline stays paired."""
    ceiling = round(1.5 * 1.15, 6)
    shares = {"default": {-1.0: 0.5}, "candidate 1": {7.0: 0.88, -1.0: 1.0}}
    seen, measure_at = fixed_world(shares)
    d = Contender("default", {}, 1.3, search_high=1.5)
    c = Contender("candidate 1", {}, 9.0, next_rate=7.0)
    r = paired_verdict(d, [c], measure_at, max_rounds=4, budget_s=math.inf, step=1.15)
    first_climb = round(math.sqrt(ceiling * 7.0), 6)
    second_climb = round(math.sqrt(first_climb * 7.0), 6)
    rates = [rate for name, rate, _ in seen if name == "candidate 1"]
    assert rates == [7.0, ceiling, first_climb, second_climb]
    assert r.winner is c and c.shown().low == pytest.approx(second_climb)
    assert [p.served_only for p in sorted(c.pools.values(), key=lambda p: p.rate)] == [False, True, True, False]
    # the climbs ran alone: the default was measured beside the candidate's first two rates and at its ceiling only
    assert sorted({rate for name, rate, _ in seen if name == "default"}) == [ceiling, 7.0]
    assert r.ratio(c).low == pytest.approx(second_climb / ceiling)
    assert "climbed to 3.47, 4.93 req/s (shown served to 4.93)" in r.stopped
    line = verdict_line(r, "p99 TBT <= 50ms")
    # the headline: the one rate measured for both on the same arrivals
    assert line.startswith("tuned serves 4.93 req/s") and "at 7 req/s on the same arrivals it attains 88.0%" in line


def test_a_climb_not_shown_served_ends_the_climbing_and_claims_no_miss() -> None:
    """A climb is a claim of "served" only: at a rate where the winner attains 50 % its pool reads undecided (the
    budget covers no "missed" there), its shown bracket keeps its ends, and no further climb starts."""
    ceiling = round(1.5 * 1.15, 6)
    climb = round(math.sqrt(ceiling * 7.0), 6)
    shares = {"default": {-1.0: 0.5}, "candidate 1": {7.0: 0.88, climb: 0.5, -1.0: 1.0}}
    seen, measure_at = fixed_world(shares)
    d = Contender("default", {}, 1.3, search_high=1.5)
    c = Contender("candidate 1", {}, 9.0, next_rate=7.0)
    r = paired_verdict(d, [c], measure_at, max_rounds=4, budget_s=math.inf, step=1.15)
    assert [rate for name, rate, _ in seen if name == "candidate 1"] == [7.0, ceiling, climb]
    pool = next(p for p in c.pools.values() if p.served_only)
    assert pool.rate == pytest.approx(climb) and pool.verdict() == "undecided" and pool.attainment().high < 0.9
    assert c.shown().low == pytest.approx(ceiling) and c.shown().high != pytest.approx(climb)
    assert r.winner is c and c.next_rate is None and "shown better after 3 rounds" in r.stopped
    assert r.as_dict()["candidates"][0]["pools"][1]["climb"] is True


def test_a_winner_two_steps_below_its_search_climbs_and_a_ceiling_that_cannot_miss_is_left() -> None:
    """The shape of a run on the engine: the candidate shown served at its first rate, two steps below its searched
    capacity (5.24 of 6.93 req/s), and the default at its own ceiling attaining 57 of 60 requests (undecided, and no
    further window as long could show it missed). The next round climbs to one step below the searched capacity and
    leaves the ceiling alone; on the engine three more rounds went to that ceiling, deciding nothing, and the winner
    never climbed."""
    step = 1.15
    ceiling = round(0.841 * step, 6)
    seen: list[tuple[str, float]] = []

    def measure_at(c: Contender, rate: float, draw: int) -> Sample:
        seen.append((c.name, round(rate, 6)))
        if c.is_default and round(rate, 6) == ceiling:
            return Sample(rate, draw, blocks(57, 60, size=3))
        return Sample(rate, draw, blocks(300 if c.is_default else 600, 600))

    d = Contender("default", {}, 0.771, search_high=0.841)
    c = Contender("candidate 1", {}, 6.93, next_rate=first_rate(6.93, d.search_high, step))
    r = paired_verdict(d, [c], measure_at, max_rounds=4, budget_s=math.inf, step=step)
    first, climb = round(6.93 / step ** 2, 6), round(6.93 / step, 6)
    assert [rate for name, rate in seen if name == "candidate 1"] == [first, climb]
    assert [rate for name, rate in seen if name == "default"] == sorted([first, ceiling])
    ceiling_pool = d.pool(ceiling)
    assert ceiling_pool is not None and ceiling_pool.verdict() == "undecided"
    assert r.winner is c and c.shown().low == pytest.approx(climb)
    assert "shown better after 2 rounds, then climbed to 6.03 req/s" in r.stopped
