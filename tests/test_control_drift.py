"""The drift monitor, simulated with the project's own code on traffic like the real: Poisson arrivals, lognormal
prompt and output lengths read through the engine's length buckets, one look a minute. On stationary traffic it
raises no more false alarms per hour than the policy states; a real 30 % shift is found within minutes; one
minute's burst is not a drift."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from engine.metrics import LENGTH_BUCKETS
from policies.control import Triggers
from tuner.control.drift import DriftMonitor, cusum_threshold, arl0
from tuner.control.shape import Shape
from tuner.control.window import Lengths

SPEC = Triggers()
BOUNDS = (*map(float, LENGTH_BUCKETS), math.inf)


def histogram(lengths: np.ndarray) -> Lengths:
    index = np.searchsorted(np.asarray(BOUNDS), np.ceil(lengths), side="left")
    return Lengths(BOUNDS, tuple(float(c) for c in np.bincount(index, minlength=len(BOUNDS))),
                   float(np.ceil(lengths).sum()))


def window(rng: np.random.Generator, rate: float, prompt: float = 100.0, output: float = 50.0) -> Shape:
    """One drift window of traffic: Poisson arrivals, lognormal lengths (sigma 0.6) around the medians."""
    n = int(rng.poisson(rate * SPEC.drift_window))
    prompts = np.maximum(1, np.round(rng.lognormal(math.log(prompt), 0.6, n)))
    outputs = np.maximum(1, np.round(rng.lognormal(math.log(output), 0.6, n)))
    return Shape(SPEC.drift_window, n, (), (), 0.0, histogram(prompts), histogram(outputs))


def first_alarm(rng: np.random.Generator, rate: float, minutes: int = 60, shift_at: float | None = None,
                rate_factor: float = 1.0, prompt_factor: float = 1.0) -> float | None:
    """Seconds into the run of the monitor's first alarm (None: none), the traffic shifting at ``shift_at``."""
    monitor = DriftMonitor(SPEC)
    for i in range(int(minutes * 60 / SPEC.drift_window)):
        shifted = shift_at is not None and i * SPEC.drift_window >= shift_at
        if monitor.add(window(rng, rate * (rate_factor if shifted else 1.0),
                              100.0 * (prompt_factor if shifted else 1.0))):
            return (i + 1) * SPEC.drift_window
    return None


def false_alarms_per_hour_hold(rate: float, hours: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    alarms = sum(first_alarm(rng, rate) is not None for _ in range(hours))
    # consistent with at most the stated rate (each hour's chance of an alarm is below its rate per hour)
    assert stats.binomtest(alarms, hours, SPEC.drift_alarms_per_hour, alternative="greater").pvalue > 0.01, alarms


def test_stationary_traffic_raises_no_more_false_alarms_per_hour_than_stated() -> None:
    """The five tests of two windows run every 2 s fired falsely in 5 of 10 such hours."""
    false_alarms_per_hour_hold(1.0, 400, seed=21)


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.4, 1.0, 4.0])
def test_the_false_alarm_rate_holds_at_low_and_high_rates(rate: float) -> None:
    false_alarms_per_hour_hold(rate, 1000, seed=22)


def test_a_real_thirty_percent_shift_is_found_within_minutes() -> None:
    rng = np.random.default_rng(23)
    rate_delays = [first_alarm(rng, 1.0, 40, 600.0, rate_factor=1.3) for _ in range(60)]
    prompt_delays = [first_alarm(rng, 1.0, 40, 600.0, prompt_factor=1.3) for _ in range(60)]
    found_rate = [d - 600 for d in rate_delays if d is not None and d > 600]
    found_prompt = [d - 600 for d in prompt_delays if d is not None and d > 600]
    assert len(found_rate) >= 0.8 * 60 and np.median(found_rate) <= 300, found_rate
    assert len(found_prompt) >= 0.9 * 60 and np.median(found_prompt) <= 180, found_prompt


def test_one_minute_of_burst_is_not_drift() -> None:
    rng = np.random.default_rng(24)
    alarms = 0
    for _ in range(100):
        monitor = DriftMonitor(SPEC)
        for i in range(40):
            alarm = monitor.add(window(rng, 3.0 if i == 20 else 1.0))
            alarms += alarm is not None and i >= 20
            if alarm:
                break
    assert alarms <= 20, alarms


def test_the_threshold_gives_the_average_run_asked_for() -> None:
    for k, looks in ((0.5, 1000.0), (1.2, 12000.0), (2.0, 50000.0)):
        assert arl0(cusum_threshold(k, looks), k) == pytest.approx(looks, rel=1e-6)
