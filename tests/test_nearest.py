"""The nearest targets a machine meets: each target the requests did not reach raised to where they did."""

from __future__ import annotations

import math

from slotune.slo import SLO
from tuner.measure.nearest import judged_at, nearest_slo, relaxation, round_up
from tuner.measure.statistics import Interval
from tuner.measure.targets import Reached


def reached(ttft: tuple[float, float, float], tbt: tuple[float, float, float], slo: SLO) -> Reached:
    share = Interval(0.5, 0.4, 0.6, 0.95, 100)
    return Reached(share, share, Interval(*ttft, 0.95, 100), Interval(*tbt, 0.95, 100), 0.9, slo.ttft_p99,
                   slo.tbt_p99)


def test_round_up_keeps_two_significant_figures_and_never_rounds_down() -> None:
    assert round_up(0.0612) == 0.062 and round_up(9.61) == 9.7 and round_up(9.6) == 9.6 and round_up(123.0) == 130.0
    assert all(round_up(x) >= x for x in (0.0101, 0.999, 1.0001, 47.3, 0.123456))


def test_a_missed_target_is_raised_to_the_upper_end_of_what_the_requests_reached_and_the_others_kept() -> None:
    slo = SLO(tbt_p99=0.05, ttft_p99=2.0)
    nearer = nearest_slo(slo, reached((7.7, 7.1, 9.61), (0.031, 0.029, 0.034), slo))
    assert nearer == SLO(tbt_p99=0.05, ttft_p99=9.7)
    assert math.isclose(relaxation(slo, nearer), 9.7 / 2.0)
    both = nearest_slo(slo, reached((2.5, 2.1, 2.91), (0.06, 0.055, 0.0612), slo))
    assert both == SLO(tbt_p99=0.062, ttft_p99=3.0)


def test_no_nearer_targets_where_every_target_was_reached_or_a_target_never_was() -> None:
    slo = SLO(tbt_p99=0.05, ttft_p99=2.0)
    assert nearest_slo(slo, reached((1.0, 0.9, 1.2), (0.03, 0.02, 0.04), slo)) is None
    # reached by the point estimate, its interval open above (few requests): kept
    assert nearest_slo(slo, reached((1.0, 0.9, math.inf), (0.036, 0.02, math.inf), slo)) is None
    # requests never answered: no finite TTFT target would be met
    assert nearest_slo(slo, reached((math.inf, 5.0, math.inf), (0.03, 0.02, 0.04), slo)) is None
    # a reached value with no upper bound: raised by half again
    assert nearest_slo(slo, reached((4.0, 3.0, math.inf), (0.03, 0.02, 0.04), slo)) == SLO(tbt_p99=0.05, ttft_p99=6.0)


def test_a_runner_judges_at_the_nearer_targets_only_inside_the_block() -> None:
    class Runner:
        slo = SLO(tbt_p99=0.05)

    runner = Runner()
    try:
        with judged_at(runner, SLO(tbt_p99=0.08)):
            assert runner.slo == SLO(tbt_p99=0.08)
            raise RuntimeError("a search that fails")
    except RuntimeError:
        pass
    assert runner.slo == SLO(tbt_p99=0.05)
