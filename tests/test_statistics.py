"""The intervals and verdicts the tuner and controller decide with, on simulated draws with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tuner.measure.dependence import attainment_interval, mean_confidence_sequence, paired_difference_interval
from tuner.measure.statistics import (Interval, bonferroni_level, lower_verdict, min_samples_to_bound,
                                      proportion_interval, quantile_interval, quantile_ranks, upper_verdict)


@pytest.mark.parametrize("n", [400, 1000, 5000])
def test_p99_interval_covers_the_true_p99_at_about_its_level(n: int) -> None:
    rng = np.random.default_rng(n)
    true_p99 = -math.log(0.01)  # exponential(1)
    reps = 2000
    hits = sum(quantile_interval(rng.exponential(size=n), 0.99, 0.95).contains(true_p99) for _ in range(reps))
    coverage = hits / reps
    # Order-statistic intervals are conservative (discrete ranks): at least the level, not far above it.
    assert 0.94 <= coverage <= 0.985, coverage


def test_too_few_samples_leave_the_p99_unbounded_above() -> None:
    # 150 gaps: the p99 is about the second-largest gap and cannot be shown to meet any target.
    est = quantile_interval(np.linspace(0.01, 0.02, 150), 0.99)
    assert est.high == math.inf and upper_verdict(est, 1.0) == "undecided"
    assert min_samples_to_bound(0.99, 0.95) == 368
    assert quantile_ranks(368, 0.99)[1] == 368 and quantile_ranks(367, 0.99)[1] == 368  # 368 > 367 = n
    big = quantile_interval(np.linspace(0.0, 0.02, 368), 0.99)
    assert big.high == pytest.approx(0.02) and upper_verdict(big, 0.05) == "met"


def test_verdicts_say_undecided_when_the_interval_straddles_the_target() -> None:
    rng = np.random.default_rng(1)
    gaps = rng.normal(0.030, 0.005, size=20000)
    est = quantile_interval(gaps, 0.99)
    assert est.low < est.value < est.high
    assert upper_verdict(est, 0.050) == "met"
    assert upper_verdict(est, 0.020) == "missed"
    assert upper_verdict(est, est.value) == "undecided"
    assert upper_verdict(quantile_interval([], 0.99), 1.0) == "undecided"


def test_proportion_interval_is_clopper_pearson() -> None:
    est = proportion_interval(45, 50)
    assert est.value == pytest.approx(0.9)
    # Known values of the exact interval for 45/50 at 95 %.
    assert est.low == pytest.approx(0.7818, abs=1e-3) and est.high == pytest.approx(0.9667, abs=1e-3)
    assert lower_verdict(est, 0.9) == "undecided"
    assert lower_verdict(proportion_interval(495, 500), 0.9) == "met"
    assert lower_verdict(proportion_interval(300, 500), 0.9) == "missed"
    assert proportion_interval(0, 0).n == 0 and lower_verdict(proportion_interval(0, 0), 0.9) == "undecided"
    assert proportion_interval(10, 10).high == 1.0


def test_the_confidence_sequence_of_bounded_means_holds_at_every_look() -> None:
    """Looking after every observation and stopping at the first that excludes the truth: at most 1 - level of the
    runs ever exclude it (a fixed-sample interval looked at this often would, far more often)."""
    rng = np.random.default_rng(11)
    truth, runs, ever = 0.9, 400, 0
    for _ in range(runs):
        x = rng.beta(9, 1, size=80)  # mean 0.9, in [0, 1]
        excluded = False
        for t in (10, 20, 40, 80):
            cs = mean_confidence_sequence(x[:t], 0.95, truth)
            excluded |= not cs.low <= truth <= cs.high
        ever += excluded
    assert ever / runs <= 0.05


def test_the_paired_difference_pairs_blocks_of_the_same_arrivals() -> None:
    same = [(9, 10)] * 60
    worse = [(5, 10)] * 60
    diff = paired_difference_interval(same, worse)
    assert diff.value == pytest.approx(0.4) and diff.low > 0.3 and diff.n == 60
    assert paired_difference_interval(same, same).contains(0.0)
    assert paired_difference_interval(same[:10], worse).n == 10  # the blocks both measured
    assert math.isnan(paired_difference_interval([], worse).value)


def test_claims_that_must_hold_together_share_the_error_rate() -> None:
    assert bonferroni_level(0.95, 5) == pytest.approx(0.99)
    assert attainment_interval([(10, 10)] * 60, bonferroni_level(0.95, 5)).low < \
        attainment_interval([(10, 10)] * 60, 0.95).low


def test_interval_formats_and_serializes_unbounded_sides() -> None:
    est = Interval(0.045, 0.040, math.inf, 0.95, 200)
    assert est.format(" ms", 1000) == "45 ms (40-?)"
    assert est.as_dict() == {"value": 0.045, "low": 0.040, "high": None, "level": 0.95, "n": 200}
