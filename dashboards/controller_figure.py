"""The Controller page's figure and table, from the controller's decision log (tuner.control.decision_log):
attainment over time with its interval and the target, the knobs over time, each decision marked on both."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

OUTCOME_COLORS = {"kept": "#2ca02c", "rolled_back": "#d62728", "abandoned": "#9467bd", "advised": "#1f77b4",
                  "no_move": "#7f7f7f"}
SHOWN_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "block_size")


def _t(x: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(x)


def controller_figure(records: Sequence[dict[str, Any]], target: float | None = None) -> go.Figure:
    """Two rows sharing time: attainment (share, with its 95 % interval) and the knobs (log scale)."""
    obs = [r for r in records if r.get("kind") == "observation" and r.get("attainment")]
    decisions = [r for r in records if r.get("kind") == "decision"]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("SLO attainment of the trigger window", "knobs"))
    times = [_t(r["time"]) for r in obs]
    att = [r["attainment"] for r in obs]
    fig.add_trace(go.Scatter(x=times, y=[a.get("high") for a in att], mode="lines", line={"width": 0},
                             showlegend=False, hoverinfo="skip"), row=1, col=1)
    fig.add_trace(go.Scatter(x=times, y=[a.get("low") for a in att], mode="lines", line={"width": 0},
                             fill="tonexty", fillcolor="rgba(31,119,180,0.2)", name="95 % interval"), row=1, col=1)
    fig.add_trace(go.Scatter(x=times, y=[a.get("value") for a in att], mode="lines+markers", name="attainment",
                             line={"color": "#1f77b4"}), row=1, col=1)
    if target is not None:
        fig.add_hline(y=target, line_dash="dash", line_color="#d62728", row=1, col=1)
    knob_obs = [r for r in records if r.get("kind") == "observation" and r.get("knobs")]
    for name in SHOWN_KNOBS:
        fig.add_trace(go.Scatter(x=[_t(r["time"]) for r in knob_obs], y=[r["knobs"].get(name) for r in knob_obs],
                                 mode="lines", line_shape="hv", name=name), row=2, col=1)
    for outcome, color in OUTCOME_COLORS.items():
        marked = [d for d in decisions if d.get("outcome") == outcome]
        if not marked:
            continue
        for row, y in ((1, 1.02), (2, None)):
            fig.add_trace(go.Scatter(
                x=[_t(d["time"]) for d in marked], y=[y if y is not None else _knob_at(knob_obs, d["time"])
                                                      for d in marked],
                mode="markers", marker={"symbol": "diamond", "size": 11, "color": color},
                name=f"decision: {outcome}", legendgroup=outcome, showlegend=row == 1,
                text=[f"#{d.get('id')} {d.get('trigger', {}).get('kind')}: {d.get('reason')}" for d in marked],
                hovertemplate="%{text}<extra></extra>"), row=row, col=1)
    fig.update_yaxes(range=[0, 1.05], title_text="share", row=1, col=1)
    fig.update_yaxes(type="log", title_text="value", row=2, col=1)
    fig.update_layout(template="plotly_white", height=620, margin={"t": 40, "b": 40},
                      title="controller" + (" (no observations yet)" if not obs else ""))
    return fig


def _knob_at(obs: Sequence[dict[str, Any]], t: float) -> float | None:
    before = [r for r in obs if r["time"] <= t]
    return (before[-1] if before else obs[0])["knobs"].get("max_num_seqs") if obs else None


def decision_rows(records: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """id, time, trigger, outcome, move, why: one row per decision, newest first."""
    rows = []
    for d in reversed([r for r in records if r.get("kind") == "decision"]):
        rows.append([d.get("id"), f"{_t(d['time']):%H:%M:%S}", (d.get("trigger") or {}).get("kind"),
                     d.get("outcome"), ", ".join(f"{k}={v}" for k, v in (d.get("candidate") or {}).items()) or "—",
                     d.get("reason")])
    return rows
