"""The intervals and verdicts the tuner and controller decide with, on simulated draws with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tuner.measure.statistics import (Interval, lower_verdict, min_samples_to_bound, paired_ratio_interval,
                              proportion_interval, quantile_interval, quantile_ranks, ratio_verdict, upper_verdict)


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


def test_paired_ratio_of_two_draws_of_one_config_is_no_difference() -> None:
    rng = np.random.default_rng(7)
    draws = rng.uniform(2.0, 4.0, size=6)  # each repeat's arrival draw moves both configs alike
    a = draws * rng.normal(1.0, 0.03, size=6)
    b = draws * rng.normal(1.0, 0.03, size=6)
    ratio = paired_ratio_interval(a, b)
    assert ratio.contains(1.0) and ratio_verdict(ratio) == "no difference beyond the noise"


def test_paired_ratio_names_the_better_config() -> None:
    rng = np.random.default_rng(8)
    draws = rng.uniform(2.0, 4.0, size=5)
    tuned = 1.5 * draws * rng.normal(1.0, 0.03, size=5)
    default = draws * rng.normal(1.0, 0.03, size=5)
    ratio = paired_ratio_interval(tuned, default)
    assert ratio.low > 1.3 and ratio.high < 1.7 and ratio_verdict(ratio) == "better"
    assert ratio_verdict(paired_ratio_interval(default, tuned)) == "worse"
    # The pairing matters: unpaired, the draws' spread (2-4) would swamp a 1.5x effect with 5 repeats.
    single = paired_ratio_interval(tuned[:1], default[:1])
    assert single.high == math.inf and ratio_verdict(single) == "no difference beyond the noise"


def test_interval_formats_and_serializes_unbounded_sides() -> None:
    est = Interval(0.045, 0.040, math.inf, 0.95, 200)
    assert est.format(" ms", 1000) == "45 ms (40-?)"
    assert est.as_dict() == {"value": 0.045, "low": 0.040, "high": None, "level": 0.95, "n": 200}
    with pytest.raises(ValueError):
        paired_ratio_interval([1.0], [1.0, 2.0])
