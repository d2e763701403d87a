"""Statistics of the engine's step records in a measurement window (the ``step_stats`` of a trial)."""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

STEP_STATS_KEYS = ("steps", "mean_batch_seqs", "mean_prefill_tokens", "mean_decode_tokens", "prefill_token_share",
                   "preemptions", "kv_usage_mean", "kv_usage_max", "step_duration_p50", "step_duration_p99",
                   "steps_dropped")


def window_steps(step_records: Iterable[dict[str, Any]], start: float, end: float = math.inf
                 ) -> list[dict[str, Any]]:
    """The step records of a measurement window: those that started from the window's opening (``start``, wall
    clock, the time base of StepRecord.start_time) until the run ended (``end``: the load test's end, its drain
    included, or the moment it was stopped).

    The window counts the requests sent in it, each to its last token, and most of those tokens are made after the
    window closes (a request sent near the end is served in the drain): the steps that made them belong to the
    window. The schedule sends nothing after the window, so the steps past its end serve only the window's
    requests. (Cut at the window's end, a short window at a low rate kept few steps, or none when one long prefill
    straddled the end.)"""
    return [r for r in step_records if start <= r["start_time"] < end]


def step_stats(step_records: list[dict[str, Any]], dropped: int = 0) -> dict[str, float]:
    """Mean batch (prefill sequences + decoding sequences, one decode token each), the prefill/decode token mix,
    preemptions, KV usage (used / (used + free) blocks) and step-duration percentiles of ``step_records``
    (dicts with the fields of the engine's StepRecord). All zeros for no records.

    ``steps_dropped``: ``dropped``, how many of the window's records the engine dropped from its ring buffer before
    they were read (tuner/trials/step_collector.py; at most that many: a gap may straddle the window's opening). Not
    zero, the statistics are those of the records kept, part of the window only."""
    if not step_records:
        return {**{k: 0.0 for k in STEP_STATS_KEYS}, "steps_dropped": float(dropped)}
    prefill = np.array([r["num_prefill_tokens"] for r in step_records], dtype=float)
    decode = np.array([r["num_decode_tokens"] for r in step_records], dtype=float)
    seqs = np.array([r["num_prefill_seqs"] for r in step_records], dtype=float) + decode
    used = np.array([r["kv_blocks_used"] for r in step_records], dtype=float)
    total = used + np.array([r["kv_blocks_free"] for r in step_records], dtype=float)
    usage = np.divide(used, total, out=np.zeros_like(used), where=total > 0)
    durations = np.array([r["total_s"] for r in step_records], dtype=float)
    tokens = prefill.sum() + decode.sum()
    return {
        "steps": float(len(step_records)),
        "mean_batch_seqs": float(seqs.mean()),
        "mean_prefill_tokens": float(prefill.mean()),
        "mean_decode_tokens": float(decode.mean()),
        "prefill_token_share": float(prefill.sum() / tokens) if tokens else 0.0,
        "preemptions": float(sum(r.get("num_preemptions", 0) for r in step_records)),
        "kv_usage_mean": float(usage.mean()),
        "kv_usage_max": float(usage.max()),
        "step_duration_p50": float(np.percentile(durations, 50)),
        "step_duration_p99": float(np.percentile(durations, 99)),
        "steps_dropped": float(dropped),
    }
