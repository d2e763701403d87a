"""Arrival processes: when each request should be sent, as offsets in seconds from the start of the run.

- ``trace``: the trace's own timestamps, stretched by a time scale (2.0 = half as fast).
- ``poisson``: exponential gaps at a rate.
- ``gamma``: Gamma-distributed gaps at a rate with a burstiness factor, as in vLLM's ``benchmark_serving``:
  the shape is ``burstiness`` (1 = Poisson, < 1 burstier, > 1 more regular), the coefficient of variation of
  the gaps is ``1 / sqrt(burstiness)``.
- ``ramp``: a Poisson process whose rate goes linearly from ``rate`` to ``ramp_to`` over the duration.
- ``constant``: evenly spaced, exactly at the rate.

Every function returns a sorted float array of offsets in ``[0, duration)``.
"""

from __future__ import annotations

import math

import numpy as np

KINDS = ("trace", "poisson", "gamma", "ramp", "constant")


def _check(rate: float, duration: float) -> None:
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if not (duration > 0 and math.isfinite(duration)):
        raise ValueError(f"duration must be > 0 s, got {duration}")


def _renewal(gaps_fn, rate: float, duration: float, rng: np.random.Generator, first_at_zero: bool) -> np.ndarray:
    """Cumulative sums of gaps until the duration; drawn in chunks so the size need not be known."""
    chunks, t = [], 0.0
    n = max(16, int(rate * duration * 1.2) + 16)
    while True:
        gaps = gaps_fn(n)
        times = t + np.cumsum(gaps)
        chunks.append(times)
        t = float(times[-1])
        if t >= duration:
            break
    out = np.concatenate(chunks)
    if first_at_zero:  # the first request goes at once rather than after one gap
        out = np.concatenate([[0.0], out[:-1]])
    return out[out < duration]


def poisson(rate: float, duration: float, rng: np.random.Generator, first_at_zero: bool = False) -> np.ndarray:
    _check(rate, duration)
    return _renewal(lambda n: rng.exponential(1.0 / rate, n), rate, duration, rng, first_at_zero)


def gamma(rate: float, burstiness: float, duration: float, rng: np.random.Generator,
          first_at_zero: bool = False) -> np.ndarray:
    _check(rate, duration)
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    shape, scale = burstiness, 1.0 / (rate * burstiness)
    return _renewal(lambda n: rng.gamma(shape, scale, n), rate, duration, rng, first_at_zero)


def constant(rate: float, duration: float) -> np.ndarray:
    _check(rate, duration)
    return np.arange(0.0, duration, 1.0 / rate)


def ramp(rate: float, ramp_to: float, duration: float, rng: np.random.Generator) -> np.ndarray:
    """Inhomogeneous Poisson with rate ``r(t) = rate + (ramp_to - rate) t / duration`` (by inverting the
    cumulative rate of a unit-rate Poisson process). Either end may be 0, not both."""
    if rate < 0 or ramp_to < 0 or rate + ramp_to <= 0:
        raise ValueError(f"ramp rates must be >= 0 and not both 0, got {rate} -> {ramp_to}")
    if not (duration > 0 and math.isfinite(duration)):
        raise ValueError(f"duration must be > 0 s, got {duration}")
    total = (rate + ramp_to) / 2.0 * duration  # expected count = integral of r(t)
    s = _renewal(lambda n: rng.exponential(1.0, n), total / duration, total, rng, False)
    a = (ramp_to - rate) / (2.0 * duration)  # Lambda(t) = a t^2 + rate t
    if abs(a) < 1e-15:
        t = s / rate
    else:  # t = (-rate + sqrt(rate^2 + 4 a s)) / (2 a), written to stay accurate when a is small
        t = 2.0 * s / (rate + np.sqrt(np.maximum(rate * rate + 4.0 * a * s, 0.0)))
    return t[t < duration]


def from_trace(trace_times: np.ndarray | list[float], time_scale: float, duration: float) -> np.ndarray:
    """The trace's offsets (seconds from its first row) times the time scale, those before the duration."""
    if not time_scale > 0:
        raise ValueError(f"time scale must be > 0, got {time_scale}")
    t = np.asarray(trace_times, dtype=float) * time_scale
    return t[t < duration]


def arrival_times(kind: str, rate: float, duration: float, rng: np.random.Generator, *, burstiness: float = 1.0,
                  ramp_to: float | None = None) -> np.ndarray:
    """Offsets for a synthetic process (everything but ``trace``, which needs the trace's times)."""
    if kind == "poisson":
        return poisson(rate, duration, rng)
    if kind == "gamma":
        return gamma(rate, burstiness, duration, rng)
    if kind == "constant":
        return constant(rate, duration)
    if kind == "ramp":
        if ramp_to is None:
            raise ValueError("ramp arrivals need ramp_to (the rate at the end)")
        return ramp(rate, ramp_to, duration, rng)
    raise ValueError(f"arrival process must be one of {', '.join(KINDS)}, got {kind!r}")
