"""The summary of a load test, computed from the raw per-request records (never from Locust's statistics).

Definitions (docs/architecture.md, "Measured quantities"):

- TTFT: intended send time -> first token received; percentiles over the requests that received a token.
- TBT: the gaps between consecutive tokens of one request; ``tbt_p*`` pool the gaps of all requests
  (what ``histogram_quantile`` over an inter-token-latency histogram estimates), including the tokens of
  requests that failed or were unfinished.
- A request *attains* the SLO when it completed (status ``ok``), its TTFT <= the TTFT target (if set), the 99th
  percentile of its own gaps <= the TBT target (no gaps: met) and its end-to-end latency <= the e2e target (if set).
  ``attainment`` = attaining / all requests in the window, failed, unfinished and unsent ones included;
  ``attainment_without_ttft`` is the same with the TTFT target left out.
- Goodput: attaining requests per second (``goodput_rps``) and their output tokens per second
  (``goodput_tokens_per_s``), over the window's duration.
- Send lag: actual minus intended send time of the requests that were sent.

Percentiles interpolate linearly between order statistics (numpy's default), so hand-made cases have exact answers.
This module imports neither locust nor gevent: the tuner calls :func:`summarize` in its own process.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any, Iterable

import numpy as np

from slotune.slo import SLO
from slotune.units import format_duration
from loadtest.records import RequestRecord, from_frame, read_records


def percentile(values: Iterable[float] | np.ndarray, q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation); None for no values."""
    a = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=float)
    if a.size == 0:
        return None
    return float(np.percentile(a, q))


def token_gaps(record: RequestRecord) -> np.ndarray:
    t = np.asarray(record.token_times, dtype=float)
    return np.diff(t) if t.size >= 2 else np.zeros(0)


def request_tbt_p99(record: RequestRecord) -> float:
    """The 99th percentile of one request's own gaps (0.0 with fewer than two tokens), numpy's linear interpolation
    written out: it runs once per request in every summary and measurement, where np.percentile's overhead was
    most of their time."""
    g = np.sort(token_gaps(record))
    if not g.size:
        return 0.0
    position = 0.99 * (g.size - 1)
    below = int(position)
    above = min(below + 1, g.size - 1)
    return float(g[below] + (g[above] - g[below]) * (position - below))


def e2e(record: RequestRecord) -> float:
    """Intended send time -> last token (or the end of the response); NaN when it never finished."""
    end = record.token_times[-1] if record.token_times else record.finish_time
    if record.status != "ok" or end is None or math.isnan(end):
        return math.nan
    return end - record.intended_send_time


def attains(record: RequestRecord, slo: SLO, use_ttft: bool = True) -> bool:
    if record.status != "ok":
        return False
    if use_ttft and slo.ttft_p99 is not None and not (record.ttft <= slo.ttft_p99):  # NaN never attains
        return False
    if slo.tbt_p99 is not None and not (request_tbt_p99(record) <= slo.tbt_p99):
        return False
    if slo.e2e_p99 is not None and not (e2e(record) <= slo.e2e_p99):
        return False
    return True


def _as_records(records: Any) -> list[RequestRecord]:
    if isinstance(records, str):
        return read_records(records)
    if hasattr(records, "to_dict") and hasattr(records, "columns"):  # a pandas DataFrame
        return from_frame(records)
    return list(records)


def _pcts(prefix: str, values: np.ndarray) -> dict[str, float | None]:
    return {
        f"{prefix}_mean": float(values.mean()) if values.size else None,
        f"{prefix}_p50": percentile(values, 50),
        f"{prefix}_p90": percentile(values, 90),
        f"{prefix}_p99": percentile(values, 99),
        f"{prefix}_max": float(values.max()) if values.size else None,
    }


def summarize(records: Any, slo: SLO | None = None, duration_s: float | None = None,
              window: tuple[float, float] | None = None, meta: dict | None = None,
              lag_warn: float = 0.010) -> dict[str, Any]:
    """Summary dict (JSON-ready; times in seconds, None where undefined) of records, a records file or a DataFrame.

    ``window=(start, end)`` keeps the requests whose ``scheduled_at`` is in ``[start, end)`` (seconds from the
    start of the run; e.g. to leave out a warm-up); rates divide by ``duration_s``, which defaults to the window's
    length, else ``meta["schedule_duration_s"]``, else the span of the intended send times.
    """
    slo = slo or SLO()
    meta = dict(meta or {})
    recs = _as_records(records)
    if window is not None:
        recs = [r for r in recs if window[0] <= r.scheduled_at < window[1]]
    out = _figures(recs, slo, _duration(recs, duration_s, window, meta), lag_warn)
    out["window"] = list(window) if window is not None else None
    lagging = out["send_lag_p99"] is not None and out["send_lag_p99"] > lag_warn
    out["generator_kept_up"] = not lagging and not out["not_sent"]
    out["warnings"] = _warnings(out, recs, lag_warn)
    for k, v in meta.items():
        out.setdefault(k, v)
    return _jsonable(out)


def _duration(recs: list[RequestRecord], duration_s: float | None, window: tuple[float, float] | None,
              meta: dict[str, Any]) -> float | None:
    """The seconds the rates divide by: ``duration_s``, else the window's length, else the schedule's, else the
    span of the intended send times (stretched by one interval per request)."""
    if duration_s is None and window is not None:
        duration_s = window[1] - window[0]
    if duration_s is None:
        duration_s = meta.get("schedule_duration_s")
    if duration_s is None and recs:
        at = [r.scheduled_at for r in recs]
        span = max(at) - min(at)
        duration_s = span * len(recs) / (len(recs) - 1) if len(recs) > 1 and span > 0 else None
    return duration_s


def _figures(recs: list[RequestRecord], slo: SLO, duration_s: float | None, lag_warn: float) -> dict[str, Any]:
    """The counts, rates, latency percentiles, attainment and send lags of the window's requests."""
    per_s = (1.0 / duration_s) if duration_s and duration_s > 0 else math.nan
    status = Counter(r.status for r in recs)
    ok = [r for r in recs if r.status == "ok"]
    ttft = np.array([r.ttft for r in recs if not math.isnan(r.ttft)], dtype=float)
    gaps = np.concatenate([token_gaps(r) for r in recs]) if recs else np.zeros(0)
    e2es = np.array([e2e(r) for r in ok], dtype=float)
    e2es = e2es[~np.isnan(e2es)]
    lags = np.array([r.send_lag for r in recs if not math.isnan(r.actual_send_time)], dtype=float)
    attaining = [r for r in recs if attains(r, slo)]
    attaining_wo_ttft = sum(attains(r, slo, use_ttft=False) for r in recs)
    n = len(recs)

    def rate(x: float) -> float | None:
        v = x * per_s
        return None if math.isnan(v) else v

    return {
        "requests": n,
        "completed": status.get("ok", 0),
        "failed": status.get("error", 0),
        "unfinished": status.get("unfinished", 0),
        "not_sent": status.get("not_sent", 0),
        "duration_s": duration_s,
        "offered_rps": rate(n),
        "throughput_rps": rate(len(ok)),
        "output_tokens_per_s": rate(sum(r.output_tokens for r in ok)),
        "prompt_tokens_per_s": rate(sum(r.prompt_tokens for r in ok)),
        **_pcts("ttft", ttft),
        **_pcts("tbt", gaps),
        "tbt_gaps": int(gaps.size),
        **_pcts("e2e", e2es),
        "attaining": len(attaining),
        "attainment": (len(attaining) / n) if n else None,
        "attainment_without_ttft": (attaining_wo_ttft / n) if n else None,
        "goodput_rps": rate(len(attaining)),
        "goodput_tokens_per_s": rate(sum(r.output_tokens for r in attaining)),
        "send_lag_p50": percentile(lags, 50),
        "send_lag_p99": percentile(lags, 99),
        "send_lag_max": float(lags.max()) if lags.size else None,
        "late_sends": int((lags > lag_warn).sum()),
        **_token_accounting(ok),
        "slo": slo.as_dict(),
    }


def _token_accounting(ok: list[RequestRecord]) -> dict[str, Any]:
    """How the finished requests' tokens arrived: the share of events that carried several tokens (their inner gaps
    are zero: received together), and the requests whose counted tokens differ from the server's usage."""
    events = sum(r.output_events for r in ok)
    multi = sum(r.multi_token_events for r in ok)
    checked = [r for r in ok if r.usage_tokens >= 0]
    return {"multi_token_event_share": (multi / events) if events else None,
            "gaps_inside_events": int(sum(max(0, r.output_tokens - r.output_events) for r in ok if r.output_events)),
            "usage_checked": len(checked),
            "usage_mismatches": sum(r.usage_tokens != r.output_tokens for r in checked)}


def _warnings(out: dict[str, Any], recs: list[RequestRecord], lag_warn: float) -> list[str]:
    """What a reader of the summary must know: a generator that fell behind, requests not sent, unfinished or
    failed (the most common errors)."""
    warnings = []
    if out["send_lag_p99"] is not None and out["send_lag_p99"] > lag_warn:
        warnings.append(f"the generator could not keep up: send lag p99 {format_duration(out['send_lag_p99'])} "
                        f"> {format_duration(lag_warn)} (latencies still count from the intended send times; "
                        f"give the load processes CPU: --realtime, more --workers, or a lower rate)")
    if out["not_sent"]:
        warnings.append(f"{out['not_sent']} requests were due but never sent (the run was stopped early)")
    if out["unfinished"]:
        warnings.append(f"{out['unfinished']} requests were still streaming when the run ended (they do not attain)")
    if out.get("usage_mismatches"):
        warnings.append(f"{out['usage_mismatches']} of {out['usage_checked']} finished requests received a "
                        "different number of tokens than the server's usage says (the server sent several tokens in "
                        "an event without listing them: its gaps are not each token's)")
    if out["failed"]:
        top = Counter(r.error.split("\n")[0][:120] for r in recs if r.status == "error").most_common(3)
        warnings.append(f"{out['failed']} requests failed: " + "; ".join(f"{c}x {e}" for e, c in top))
    return warnings


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return None if math.isnan(v) or math.isinf(v) else v
    if isinstance(x, np.integer):
        return int(x)
    return x


def write_summary(path: str, summary: dict) -> None:
    with open(path, "w") as f:
        json.dump(summary, f, indent=2, sort_keys=False)
        f.write("\n")


def format_summary_table(s: dict) -> str:
    """The summary as an aligned two-column table (what ``slotune loadtest`` prints at the end)."""
    d = format_duration

    def num(v: Any, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    def pct(v: Any) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    slo = s.get("slo") or {}
    slo_txt = ", ".join(f"{k} <= {d(v)}" for k, v in slo.items() if v is not None) or "none"
    scales = f"length x{s.get('length_scale', 1)}"
    if s.get("output_scale") not in (None, s.get("length_scale")):
        scales += f", output x{s.get('output_scale')}"
    if s.get("time_scale") not in (None, 1.0):
        scales += f", time x{s['time_scale']:.4g}"
    if s.get("max_context"):
        scales += f", clipped to {s['max_context']} ({s.get('clipped_requests', 0)} requests)"
    rows = [
        ("workload", f"{s.get('workload', '?')} ({s.get('arrival', '?')} arrivals, {scales})"),
        ("SLO", slo_txt),
        ("requests", f"{s['requests']} in {d(s['duration_s'])}: {s['completed']} ok, {s['failed']} failed, "
                     f"{s['unfinished']} unfinished, {s['not_sent']} not sent"),
        ("offered / throughput", f"{num(s['offered_rps'])} / {num(s['throughput_rps'])} req/s, "
                                 f"{num(s['output_tokens_per_s'], '{:.1f}')} output tok/s"),
        ("TTFT p50 / p90 / p99", f"{d(s['ttft_p50'])} / {d(s['ttft_p90'])} / {d(s['ttft_p99'])}"),
        ("TBT p50 / p90 / p99", f"{d(s['tbt_p50'])} / {d(s['tbt_p90'])} / {d(s['tbt_p99'])}  "
                                f"({s['tbt_gaps']} gaps, max {d(s['tbt_max'])})"),
        ("E2E p50 / p99", f"{d(s['e2e_p50'])} / {d(s['e2e_p99'])}"),
        ("attainment", f"{pct(s['attainment'])} (without TTFT target: {pct(s['attainment_without_ttft'])})"),
        ("goodput", f"{num(s['goodput_rps'])} req/s, {num(s['goodput_tokens_per_s'], '{:.1f}')} tok/s"),
        ("send lag p50 / p99 / max", f"{d(s['send_lag_p50'])} / {d(s['send_lag_p99'])} / {d(s['send_lag_max'])}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"WARNING: {w}" for w in s.get("warnings", [])]
    return "\n".join(lines)
