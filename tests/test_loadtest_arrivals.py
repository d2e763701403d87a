"""Arrival processes: rates, burstiness, ramps; and the duration parser the options use."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.arrivals import arrival_times, constant, from_trace, gamma, poisson, ramp
from slotune.units import format_duration, parse_duration


def cv(t):
    g = np.diff(t)
    return g.std() / g.mean()


def test_poisson_rate_and_cv():
    t = poisson(20.0, 2000.0, np.random.default_rng(0))
    assert len(t) / 2000.0 == pytest.approx(20.0, rel=0.02)
    assert cv(t) == pytest.approx(1.0, abs=0.03)
    assert t.min() >= 0 and t.max() < 2000.0 and np.all(np.diff(t) >= 0)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_burstiness_sets_the_cv(burstiness):
    t = gamma(10.0, burstiness, 4000.0, np.random.default_rng(1))
    assert len(t) / 4000.0 == pytest.approx(10.0, rel=0.04)
    assert cv(t) == pytest.approx(1 / np.sqrt(burstiness), rel=0.06)


def test_ramp_rate_rises_linearly():
    t = ramp(10.0, 30.0, 1000.0, np.random.default_rng(2))
    counts, _ = np.histogram(t, bins=4, range=(0, 1000))
    # expected per quarter: integral of 10 + 20 t/1000 over each 250 s
    expected = [250 * (10 + 20 * (q + 0.5) / 4) for q in range(4)]
    assert counts == pytest.approx(expected, rel=0.05)
    assert len(ramp(0.0, 20.0, 100.0, np.random.default_rng(3))) == pytest.approx(1000, rel=0.1)


def test_constant_trace_and_dispatch():
    assert constant(4.0, 1.0).tolist() == [0.0, 0.25, 0.5, 0.75]
    assert from_trace([0.0, 1.0, 2.0, 3.0], 2.0, 5.0).tolist() == [0.0, 2.0, 4.0]
    rng = np.random.default_rng(0)
    assert len(arrival_times("gamma", 5.0, 10.0, rng, burstiness=0.5)) > 0
    with pytest.raises(ValueError):
        arrival_times("ramp", 5.0, 10.0, rng)
    with pytest.raises(ValueError):
        arrival_times("zipf", 5.0, 10.0, rng)
    with pytest.raises(ValueError):
        poisson(0.0, 10.0, rng)


@pytest.mark.parametrize("text,seconds", [("50ms", 0.05), ("2s", 2.0), ("1m", 60.0), ("1m30s", 90.0),
                                          ("250us", 0.00025), ("1.5", 1.5), ("1h", 3600.0), (3, 3.0)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "fast", "5x", "-1s", "1m30", "inf", True])
def test_parse_duration_rejects(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_format_duration():
    assert [format_duration(x) for x in (0.0005, 0.0123, 0.05, 1.5, 125.0, None)] == [
        "500us", "12.3ms", "50ms", "1.50s", "2m05.0s", "-"]
