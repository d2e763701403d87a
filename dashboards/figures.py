"""Every figure of the dashboard, built from plain data (sweeps, study rows, step records, request records) so
tests call these functions directly; the Dash callbacks only load data and call them.

Conventions: TBT in milliseconds, TTFT in seconds; SLO targets as dashed red lines; infeasible points as crosses;
simulated results say so in the title and are drawn dashed."""

from __future__ import annotations

import datetime as dt
import textwrap
from typing import Any, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.knobs import axis_label
from dashboards.analysis import Knee, find_knee, pareto_front
from dashboards.engine_client import HistogramBuckets
from dashboards.results import Sweep
from dashboards.study import TrialRow

TEMPLATE = "plotly_white"
SLO_COLOR = "#d62728"
KNEE_COLOR = "#ff7f0e"
FEASIBLE_COLOR = "#2ca02c"
INFEASIBLE_COLOR = "#d62728"
# Steps further apart than this (end of one to start of the next) had the engine idle in between: the step
# timeline breaks its lines there instead of drawing a slope across the idle time.
IDLE_BREAK_S = 0.1
EMPTY_LINE_CHARS = 60  # an empty figure's message is wrapped at this width

# (summary key, subplot title, scale to the axis unit)
CURVE_METRICS: list[tuple[str, str, float]] = [
    ("output_tokens_per_s", "output tokens/s", 1.0),
    ("goodput_rps", "goodput (req/s within the SLO)", 1.0),
    ("tbt_p99", "p99 TBT (ms)", 1000.0),
    ("ttft_p99", "p99 TTFT (s)", 1.0),
]


def empty_figure(message: str, height: int = 300) -> go.Figure:
    """A blank figure that says why there is nothing to draw (in lines that fit a half-width graph)."""
    fig = go.Figure()
    fig.add_annotation(text="<br>".join(textwrap.wrap(message, EMPTY_LINE_CHARS)) or message, showarrow=False,
                       x=0.5, y=0.5, xref="paper", yref="paper", font={"size": 15, "color": "#666"})
    fig.update_layout(template=TEMPLATE, height=height, xaxis={"visible": False}, yaxis={"visible": False})
    return fig


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


# Curves ---------------------------------------------------------------------------------------------------------
def sweep_knee(sweep: Sweep) -> Knee | None:
    """The sweep's knee on output tokens/s and p99 TBT against its SLO (None for a non-numeric knob)."""
    if not sweep.numeric or len(sweep.points) < 2:
        return None
    points = sweep.sorted_points()
    return find_knee([p.value for p in points], [p.metric("output_tokens_per_s") for p in points],
                     [p.metric("tbt_p99") for p in points], sweep.slo.get("tbt_p99"))


def sweep_curves_figure(sweep: Sweep) -> go.Figure:
    """Output tokens/s, goodput, p99 TBT and p99 TTFT against the knob, the SLO lines and the knee."""
    points = sweep.sorted_points()
    x = [p.value for p in points]
    knee = sweep_knee(sweep)
    fig = make_subplots(rows=2, cols=2, subplot_titles=[title for _, title, _ in CURVE_METRICS],
                        horizontal_spacing=0.1, vertical_spacing=0.16)
    symbols = ["circle" if p.feasible else "x" for p in points]
    hover = [f"{sweep.knob}={p.value}<br>{'feasible' if p.feasible else 'infeasible: ' + str(p.reason)}"
             for p in points]
    slo_by_metric = {"tbt_p99": _ms(sweep.slo.get("tbt_p99")), "ttft_p99": sweep.slo.get("ttft_p99")}
    for i, (key, title, scale) in enumerate(CURVE_METRICS):
        row, col = divmod(i, 2)
        y = [None if (v := p.metric(key)) is None else v * scale for p in points]
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=key, text=hover, showlegend=False,
                                 hovertemplate="%{text}<br>" + title + ": %{y:.4g}<extra></extra>",
                                 line={"dash": "dash" if sweep.simulated else "solid"},
                                 marker={"symbol": symbols, "size": 9}), row=row + 1, col=col + 1)
        target = slo_by_metric.get(key)
        if target is not None:
            fig.add_hline(y=target, line={"color": SLO_COLOR, "dash": "dash"}, row=row + 1, col=col + 1,
                          annotation_text="SLO", annotation_position="top left")
        if knee is not None:
            fig.add_vline(x=knee.value, line={"color": KNEE_COLOR, "dash": "dot"}, row=row + 1, col=col + 1)
            if key == "output_tokens_per_s":
                fig.add_trace(go.Scatter(x=[knee.value], y=[y[knee.index]], mode="markers", name="knee",
                                         marker={"symbol": "star", "size": 18, "color": KNEE_COLOR},
                                         hovertemplate=f"knee ({knee.reason})<extra></extra>", showlegend=False),
                              row=1, col=1)
    kind = " — SIMULATED" if sweep.simulated else ""
    knee_text = (f"knee at {sweep.knob}={knee.value:g} ("
                 f"{'SLO crossed at the next value' if knee.reason == 'slo' else 'gain of the next step < 10 %'})"
                 if knee else "no knee in this range")
    fig.update_layout(template=TEMPLATE, height=620, margin={"t": 90},
                      title={"text": f"sweep of {sweep.knob}{kind}<br><sup>{knee_text}</sup>"})
    fig.update_xaxes(title_text=axis_label(sweep.knob), type="log" if sweep.numeric and _log_spaced(x) else "-")
    return fig


def _log_spaced(x: Sequence[Any]) -> bool:
    """Doubling sweeps (4, 8, 16, 32) read better on a log axis."""
    v = [float(a) for a in x]
    return len(v) >= 3 and v[0] > 0 and v[-1] / v[0] >= 8


# Study ----------------------------------------------------------------------------------------------------------
def _when(row: TrialRow) -> dt.datetime | int:
    return row.completed or row.started or row.number


# The y axis of the trials over time: what the objective is (docs/tuning.md)
OBJECTIVE_AXIS = {"goodput": "objective (goodput, req/s)", "capacity": "objective (capacity, req/s)"}


def _bracket_text(r: TrialRow) -> str:
    if r.bracket is None:
        return ""
    low, high = r.bracket
    return f"<br>bracket {low:.3g}-{'?' if high is None else f'{high:.3g}'} req/s"


def _bracket_bars(group: Sequence[TrialRow]) -> dict[str, Any] | None:
    """Error bars from each point (a capacity: the bracket's low end) to its bracket's ends; an open high end, or a
    trial without a bracket, draws none above. None when no trial of the group has a bracket."""
    if not any(r.bracket is not None for r in group):
        return None
    up, down = [], []
    for r in group:
        low, high = r.bracket if r.bracket is not None else (None, None)
        value = r.value or 0.0
        up.append(max(high - value, 0.0) if high is not None else 0.0)
        down.append(max(value - low, 0.0) if low is not None else 0.0)
    return {"type": "data", "symmetric": False, "array": up, "arrayminus": down, "thickness": 1.5, "width": 6}


def history_figure(rows: Sequence[TrialRow], direction: str = "maximize", objective: str = "goodput") -> go.Figure:
    """Each trial's objective over time, feasible vs infeasible, and the best feasible value so far; a capacity
    trial's point carries its searched bracket as error bars."""
    scored = [r for r in rows if r.value is not None]
    if not scored:
        return empty_figure("no completed trial yet")
    scored.sort(key=lambda r: (r.completed or r.started or dt.datetime.max, r.number))
    fig = go.Figure()
    for feasible, name, color, symbol in ((True, "feasible", FEASIBLE_COLOR, "circle"),
                                          (False, "infeasible", INFEASIBLE_COLOR, "x")):
        group = [r for r in scored if r.feasible == feasible]
        fig.add_trace(go.Scatter(
            x=[_when(r) for r in group], y=[r.value for r in group], mode="markers", name=name,
            marker={"color": color, "symbol": symbol, "size": 9}, error_y=_bracket_bars(group),
            text=[f"trial {r.number}{' (simulated)' if r.simulated else ''}{_bracket_text(r)}<br>{r.reason or ''}"
                  for r in group],
            hovertemplate=f"%{{text}}<br>{objective} %{{y:.4g}} req/s<extra></extra>"))
    best_x, best_y, best = [], [], None
    better = (lambda a, b: a > b) if direction == "maximize" else (lambda a, b: a < b)
    for r in scored:
        if r.feasible and r.value is not None and (best is None or better(r.value, best)):
            best = r.value
        if best is not None:
            best_x.append(_when(r))
            best_y.append(best)
    fig.add_trace(go.Scatter(x=best_x, y=best_y, mode="lines", name="best so far", line={"shape": "hv"}))
    fig.update_layout(template=TEMPLATE, height=380, title="trials over time", xaxis_title="trial finished",
                      yaxis_title=OBJECTIVE_AXIS.get(objective, f"objective ({objective})"))
    return fig


def pareto_figure(rows: Sequence[TrialRow], slo_tbt: float | None = None) -> go.Figure:
    """Throughput against p99 TBT of every measured trial, with the Pareto front (more throughput, less TBT)."""
    measured = [r for r in rows if r.throughput is not None and r.tbt_p99 is not None]
    if not measured:
        return empty_figure("no trial with a load-test summary yet")
    front = pareto_front([r.throughput for r in measured], [r.tbt_p99 for r in measured])
    fig = go.Figure()
    for feasible, name, color, symbol in ((True, "feasible", FEASIBLE_COLOR, "circle"),
                                          (False, "infeasible", INFEASIBLE_COLOR, "x")):
        group = [r for r in measured if r.feasible == feasible]
        fig.add_trace(go.Scatter(x=[_ms(r.tbt_p99) for r in group], y=[r.throughput for r in group],
                                 mode="markers", name=name, marker={"color": color, "symbol": symbol, "size": 9},
                                 text=[f"trial {r.number}" for r in group],
                                 hovertemplate="%{text}<br>p99 TBT %{x:.1f} ms<br>%{y:.4g} tok/s<extra></extra>"))
    fig.add_trace(go.Scatter(x=[_ms(measured[i].tbt_p99) for i in front], y=[measured[i].throughput for i in front],
                             mode="lines+markers", name="Pareto front", line={"shape": "hv", "color": "#1f77b4"},
                             marker={"size": 13, "symbol": "circle-open"},
                             text=[f"trial {measured[i].number}" for i in front],
                             hovertemplate="%{text}<extra>Pareto front</extra>"))
    if slo_tbt is not None:
        fig.add_vline(x=_ms(slo_tbt), line={"color": SLO_COLOR, "dash": "dash"}, annotation_text="SLO")
    fig.update_layout(template=TEMPLATE, height=380, title="Pareto front: throughput vs p99 TBT",
                      xaxis_title="p99 TBT (ms)", yaxis_title="output tokens/s")
    return fig


def importance_figure(importances: dict[str, float], note: str = "") -> go.Figure:
    """Optuna's parameter importance as bars; without one, ``note`` says why (dashboards.analysis.importance_gap)."""
    if not importances:
        return empty_figure(note or "parameter importance needs at least 3 completed trials with sampled knobs, "
                                    "more than the knobs searched, and different objective values")
    names = list(importances)[::-1]  # most important on top
    fig = go.Figure(go.Bar(x=[importances[n] for n in names], y=names, orientation="h", name="importance"))
    fig.update_layout(template=TEMPLATE, height=80 + 40 * len(names), title="parameter importance (Optuna)",
                      xaxis_title="relative importance (sums to 1)", margin={"l": 180})
    return fig


# Steps (Live and Trial detail) ----------------------------------------------------------------------------------
STEP_PANELS = ["step duration (ms)", "tokens per step", "requests", "KV cache usage", "preemptions per step"]


def step_timeline_figure(steps: Sequence[dict[str, Any]], wall_clock: bool = False, title: str = "engine steps"
                         ) -> go.Figure:
    """The step records as five stacked panels: step time, prefill/decode tokens, running/waiting/preempted
    requests, KV cache usage, preemptions. x: wall-clock time (Live) or seconds from the first step. Lines break
    where the engine sat idle between two steps."""
    if not steps:
        return empty_figure("no engine steps recorded", height=300)
    # numpy arrays travel to the browser as compact base64 typed arrays (a poll of 1000 steps stays small)
    start = np.array([s["start_time"] for s in steps], dtype=float)
    x = start * 1000.0 if wall_clock else start - start[0]  # a date axis reads numbers as epoch milliseconds
    def col(k: str) -> np.ndarray:
        return np.array([s.get(k, 0) for s in steps], dtype=float)

    used, free = col("kv_blocks_used"), col("kv_blocks_free")
    usage = np.divide(used, used + free, out=np.zeros_like(used), where=(used + free) > 0)
    # a NaN point after each step followed by idle time: plotly does not connect across it
    idle_after = np.flatnonzero(start[1:] - (start[:-1] + col("total_s")[:-1]) > IDLE_BREAK_S) + 1
    x = np.insert(x, idle_after, np.nan)
    fig = make_subplots(rows=5, cols=1, shared_xaxes=True, subplot_titles=STEP_PANELS, vertical_spacing=0.05)
    panels: list[tuple[int, str, np.ndarray]] = [
        (1, "step time", col("total_s") * 1000.0),
        (2, "prefill tokens", col("num_prefill_tokens")),
        (2, "decode tokens", col("num_decode_tokens")),
        (3, "running", col("num_running")),
        (3, "waiting", col("num_waiting")),
        (3, "preempted", col("num_preempted")),
        (4, "KV usage", usage),
        (5, "preemptions", col("num_preemptions")),
    ]
    for row, name, y in panels:
        fig.add_trace(go.Scatter(x=x, y=np.insert(y, idle_after, np.nan).astype(np.float32), mode="lines", name=name,
                                 legendgroup=str(row)),
                      row=row, col=1)
    if wall_clock:
        fig.update_xaxes(type="date")
    fig.update_yaxes(range=[0, 1], row=4, col=1)
    fig.update_xaxes(title_text="time (UTC)" if wall_clock else "seconds from the first step", row=5, col=1)
    fig.update_layout(template=TEMPLATE, height=900, title=title, legend={"orientation": "h", "y": -0.08})
    return fig


def itl_histogram_figure(buckets: HistogramBuckets, slo_tbt: float | None = None) -> go.Figure:
    """The TBT distribution from the engine's inter-token-latency histogram (counts per bucket since start)."""
    if buckets.total <= 0:
        return empty_figure("no tokens streamed yet (the inter-token latency histogram is empty)")
    labels = [("≤ " if u != float("inf") else "> ") + (f"{u * 1000:g} ms" if u != float("inf")
                                                        else f"{buckets.upper[-2] * 1000:g} ms")
              for u in buckets.upper]
    fig = go.Figure(go.Bar(x=labels, y=buckets.counts, name="gaps"))
    p50, p99 = buckets.quantile(0.5), buckets.quantile(0.99)
    sub = f"{int(buckets.total)} gaps; p50 ≈ {p50 * 1000:.1f} ms, p99 ≈ {p99 * 1000:.1f} ms" if p50 and p99 else ""
    if slo_tbt is not None:
        sub += f"; SLO p99 ≤ {slo_tbt * 1000:g} ms"
    fig.update_layout(template=TEMPLATE, height=340, title={"text": f"TBT distribution<br><sup>{sub}</sup>"},
                      xaxis_title="inter-token latency bucket", yaxis_title="gaps", margin={"t": 80})
    return fig


def request_distributions_figure(records: Sequence[Any], slo: dict[str, float | None] | None = None) -> go.Figure:
    """Per-request TTFT, and TBT (every gap pooled, and each request's own p99), of one load test."""
    from loadtest.summary import request_tbt_p99, token_gaps  # the summary's own definitions

    if not records:
        return empty_figure("this trial has no request records")
    slo = slo or {}
    ttft = [r.ttft for r in records if r.ttft == r.ttft]  # NaN: no first token
    gaps = np.concatenate([token_gaps(r) for r in records]) * 1000.0
    own_p99 = [request_tbt_p99(r) * 1000.0 for r in records if len(r.token_times) >= 2]
    fig = make_subplots(rows=1, cols=2, subplot_titles=["TTFT per request (s)", "TBT (ms)"])
    fig.add_trace(go.Histogram(x=ttft, name="TTFT", nbinsx=40), row=1, col=1)
    fig.add_trace(go.Histogram(x=list(gaps), name="all gaps", nbinsx=60, histnorm="probability"), row=1, col=2)
    fig.add_trace(go.Histogram(x=own_p99, name="each request's p99", nbinsx=60, histnorm="probability",
                               opacity=0.6), row=1, col=2)
    if slo.get("ttft_p99") is not None:
        fig.add_vline(x=slo["ttft_p99"], line={"color": SLO_COLOR, "dash": "dash"}, row=1, col=1)
    tbt_p99 = slo.get("tbt_p99")
    if tbt_p99 is not None:
        fig.add_vline(x=tbt_p99 * 1000.0, line={"color": SLO_COLOR, "dash": "dash"}, row=1, col=2,
                      annotation_text="SLO")
    fig.update_layout(template=TEMPLATE, height=380, barmode="overlay", title="request latencies")
    return fig
