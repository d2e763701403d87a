"""The one reader of an engine's Prometheus text for the tuner's trials: the same quantities from slotune's series
or from vLLM's (its ``vllm:`` names), so that the idle check, the engine-side inter-token latency beside the client's
and the pruning of a lost window work on either engine.

Series are summed over their labels (vLLM labels every series with its model and engine index). A server whose
``/metrics`` lacks a series reads as "not reported" (None or an empty histogram), never as zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from engine import metric_names as names


@dataclass(frozen=True)
class EngineSeries:
    """The names of the series a trial reads, on one engine."""

    inter_token_latency: str  # histogram (seconds) of the gaps between a request's tokens
    time_to_first_token: str  # histogram (seconds)
    running: str  # gauge: requests in the running batch
    waiting: str  # gauge: requests queued


SLOTUNE_SERIES = EngineSeries(names.INTER_TOKEN_LATENCY, names.TTFT, names.RUNNING, names.WAITING)
VLLM_SERIES = EngineSeries("vllm:inter_token_latency_seconds", "vllm:time_to_first_token_seconds",
                           "vllm:num_requests_running", "vllm:num_requests_waiting")


def histogram_buckets(metrics_text: str, name: str, labels: dict[str, str] | None = None) -> dict[float, float]:
    """{upper bound: cumulative count} of histogram ``name`` (+Inf included), summed over its series, or only the
    series whose labels (``le`` aside) are exactly ``labels``; empty when the text has no such histogram."""
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != name:
            continue
        for s in family.samples:
            if s.name != name + "_bucket":
                continue
            if labels is not None and {k: v for k, v in s.labels.items() if k != "le"} != labels:
                continue
            bound = float(s.labels["le"])
            out[bound] = out.get(bound, 0.0) + s.value
    return dict(sorted(out.items()))


def gauges_by_label(metrics_text: str, name: str, label: str) -> dict[str, float]:
    """{value of ``label``: sample value} of gauge ``name`` ("" for a series without the label)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name == name:
            for s in family.samples:
                if s.name == name:
                    out[s.labels.get(label, "")] = float(s.value)
    return out


def gauge_sum(metrics_text: str, name: str) -> float | None:
    """Gauge ``name`` summed over its labels; None when the text has no such series."""
    total: float | None = None
    for family in text_string_to_metric_families(metrics_text):
        if family.name != name:
            continue
        for s in family.samples:
            if s.name == name and math.isfinite(s.value):
                total = (total or 0.0) + s.value
    return total


def queued(metrics_text: str, series: EngineSeries) -> float | None:
    """Requests running or waiting, from the gauges; None when the engine reports neither."""
    running, waiting = gauge_sum(metrics_text, series.running), gauge_sum(metrics_text, series.waiting)
    if running is None and waiting is None:
        return None
    return (running or 0.0) + (waiting or 0.0)


def engine_itl_p99(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The engine-side p99 inter-token latency between two histogram snapshots: the upper bound of the bucket
    that holds the 99th percentile (None without gaps). Beside the client-side p99 it shows what the load
    generator adds."""
    bounds = sorted(after)
    total = after.get(math.inf, 0.0) - before.get(math.inf, 0.0)
    if total <= 0:
        return None
    for b in bounds:
        if after[b] - before.get(b, 0.0) >= 0.99 * total:
            return b if math.isfinite(b) else None
    return None
