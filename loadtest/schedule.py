"""The schedule: every request of a run with its intended send time, built once from a LoadConfig.

Building is deterministic (seeded), so the same config gives the same schedule in any process. For several load
processes the schedule is split round-robin by request index: process ``rank`` of ``n`` sends the requests with
``index % n == rank``; together they send each request exactly once, at the time the one schedule says.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from loadtest.arrivals import arrival_times, from_trace
from loadtest.config import LoadConfig
from loadtest.traces import TraceWorkload
from loadtest.workloads import LengthOptions, RequestSpec, Workload, open_workload


@dataclass
class Schedule:
    requests: list[RequestSpec]  # sorted by intended send time; requests[i].index == i
    duration_s: float  # the window the requests were drawn over (what rates are divided by)
    meta: dict = field(default_factory=dict)

    def share(self, rank: int, n: int) -> list[RequestSpec]:
        if not 0 <= rank < n:
            raise ValueError(f"rank {rank} not in 0..{n - 1}")
        return [r for r in self.requests if r.index % n == rank]

    def __len__(self) -> int:
        return len(self.requests)


def open_config_workload(cfg: LoadConfig) -> Workload:
    lengths = LengthOptions(cfg.length_scale, cfg.output_scale, cfg.max_context)
    return open_workload(cfg.workload, lengths, cfg.seed, mix=cfg.mix, mix_weights=cfg.mix_weights,
                         prefix_groups=cfg.prefix_groups, prefix_len=cfg.prefix_len, suffix_len=cfg.suffix_len,
                         prefix_output_len=cfg.prefix_output_len, trace_offset_s=cfg.trace_offset)


def segment_start(latest_s: float, seed: int) -> float:
    """Where a trace segment starts for draw ``seed``: uniform over [0, ``latest_s``], the starts whose segment
    ends within the trace; 0 when none does (the trace is no longer than the segment)."""
    return float(np.random.default_rng([seed, 7]).uniform(0.0, latest_s)) if latest_s > 0 else 0.0


def draw_segment(wl: TraceWorkload, seed: int, rate: float | None, duration: float, time_scale: float) -> float:
    """Start ``wl`` at the segment draw ``seed`` picks and return the segment's time scale. With a ``rate`` the
    segment offers it: its next round(rate x duration) requests, their own gaps scaled so that the one after them
    arrives as the window ends (the start uniform over the times that leave that many rows). A drawn segment's rate
    is its own, not the whole trace's: three minutes of the Azure conversation trace run at 0.75-1.4x its mean rate
    (5th-95th percentile), so at the whole trace's rate one draw's load would say little about another's."""
    n = max(1, round(rate * duration)) if rate else 0
    if not n or len(wl.rows) <= n + 1:  # a time scale given, or a trace shorter than the window: the trace's scale
        wl.start_at(segment_start(wl.span_s - duration / time_scale, seed))
        return time_scale
    latest = wl.rows[-1 - n].time - wl.rows[0].time  # the latest start that leaves n rows after it
    wl.start_at(segment_start(latest, seed))
    end = wl.rows[n].time  # the row after the segment's n, from the segment's start
    return duration / end if end > 0 else time_scale


def build_schedule(cfg: LoadConfig) -> Schedule:
    wl = open_config_workload(cfg)
    arrival = cfg.arrival or ("trace" if wl.has_timestamps else "poisson")
    time_scale = None
    truncated = False
    if arrival == "trace":
        if not isinstance(wl, TraceWorkload):
            raise ValueError("arrival 'trace' needs a trace workload (a .csv or .jsonl file)")
        if cfg.time_scale is not None and cfg.rate is not None:
            raise ValueError("give --rate or --time-scale for a trace's own timestamps, not both")
        time_scale = cfg.time_scale or (wl.mean_rate / cfg.rate if cfg.rate else 1.0)
        if cfg.trace_segment_seed is not None:
            time_scale = draw_segment(wl, cfg.trace_segment_seed, cfg.rate, cfg.duration, time_scale)
        times = from_trace([r.time for r in wl.rows], time_scale, cfg.duration)
        truncated = len(times) == len(wl.rows)  # the trace ended before the duration
    else:
        if cfg.trace_segment_seed is not None:
            raise ValueError("--trace-segment-seed draws a segment of a trace replayed on its own timestamps")
        if cfg.time_scale not in (None, 1.0):
            raise ValueError("--time-scale stretches a trace's own timestamps; with synthetic arrivals set --rate")
        rng = np.random.default_rng([cfg.seed, 4])
        times = arrival_times(arrival, cfg.rate or 1.0, cfg.duration, rng, burstiness=cfg.burstiness,
                              ramp_to=cfg.ramp_to)
    if cfg.max_requests is not None and len(times) > cfg.max_requests:
        times, truncated = times[: cfg.max_requests], True
    requests = [replace(spec, at=float(t)) for spec, t in zip(wl.specs(), times)]
    duration = cfg.duration
    if truncated and len(requests) > 1:  # the requests ran out early: their own span (plus one mean gap)
        last = requests[-1].at
        duration = min(cfg.duration, last + last / (len(requests) - 1)) or cfg.duration
    meta = {
        **wl.describe(),
        "arrival": arrival,
        "rate": cfg.rate,
        "time_scale": time_scale,
        "burstiness": cfg.burstiness if arrival == "gamma" else None,
        "ramp_to": cfg.ramp_to if arrival == "ramp" else None,
        "scheduled_requests": len(requests),
        "schedule_duration_s": duration,
        "offered_rps": len(requests) / duration if duration > 0 else None,
        "clipped_requests": wl.clipped,
        "max_requests": cfg.max_requests,
        "token_range": cfg.token_range,
    }
    return Schedule(requests, duration, meta)

