"""What ``tune`` leaves behind: ``tuned.yaml`` (loadable by ``slotune serve --config``), the equivalent
``vllm serve`` flags, and an HTML report (plotly) of the study's trials."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import optuna
import yaml

from engine.knobs import KNOBS, flag_words, short_knobs
from slotune.slo import SLO
from slotune.units import format_duration
from tuner.search.study import feasible, measured
from tuner.search.trial_record import TrialRecord

HF_NAMES = {"SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
MEASURE_KEYS = ("goodput_rps", "goodput_tokens_per_s", "attainment", "tbt_p50", "tbt_p99", "ttft_p50", "ttft_p99",
                "e2e_p99", "throughput_rps", "offered_rps", "requests", "completed")


def measurement(summary: dict[str, Any] | None) -> dict[str, Any]:
    return {k: (summary or {}).get(k) for k in MEASURE_KEYS}


def vllm_model_name(model: str | None) -> str:
    if not model:
        return "MODEL"
    base = Path(model).name.split(".Q")[0].removesuffix(".gguf")
    return HF_NAMES.get(base, model)


def vllm_command(knobs: dict[str, Any], model: str | None) -> str:
    """The ``vllm serve`` command line with the same knobs (chunked prefill on: chunk_size needs it); a knob without
    a vLLM flag is left out (`vllm_notes` says so)."""
    parts = ["vllm serve", vllm_model_name(model), "--enable-chunked-prefill"]
    for knob in KNOBS:
        value = knobs.get(knob.name)
        if knob.vllm_flag is None or value is None:
            continue
        parts.append(" ".join(flag_words(knob.vllm_flag, value)))
    return " \\\n    ".join(parts)


def vllm_notes(knobs: dict[str, Any]) -> list[str]:
    """What the vLLM command cannot carry: each knob without a vLLM flag that is not at its default."""
    return [f"{k.name}={knobs[k.name]}: {k.vllm_note}" for k in KNOBS
            if k.vllm_note and k.name in knobs and knobs[k.name] not in (None, k.default)]


MEASURED_ON_SLOTUNE = ("measured on slotune's engine, not on vLLM: how far it carries over is measured by "
                      "`tune --engine vllm --check FILE` (docs/engines.md)")


def write_vllm(path: Path, knobs: dict[str, Any], model: str | None, engine: str = "slotune") -> str:
    """The ``vllm serve`` command of ``knobs``, with where the knobs were measured (on ``engine``) and what the
    command cannot carry."""
    text = vllm_command(knobs, model)
    where = MEASURED_ON_SLOTUNE if engine == "slotune" else f"measured on {engine} itself, a server per configuration"
    notes = [where] + vllm_notes(knobs)
    path.write_text(text + "\n" + "".join(f"# {n}\n" for n in notes))
    return text


def write_tuned_yaml(path: Path, *, knobs: dict[str, Any], slo: dict[str, Any], workload: dict[str, Any],
                     rate: float, rate_reason: str, objective: str, model: str | None, study_name: str,
                     storage: str, tuned: optuna.trial.FrozenTrial | None, default: optuna.trial.FrozenTrial | None,
                     remeasured: dict[str, Any] | None, vllm: str, report: Path, trials: int,
                     capacity: dict[str, Any] | None = None, evidence: dict[str, Any] | None = None) -> None:
    """``capacity`` (the capacity objective): ``tuned`` and ``default`` with each config's capacity and its
    interval, and the ratio; ``evidence``: the verdict's pooled measurements, the floor. Else the goodput trials'
    figures."""
    if capacity is not None:
        doc: dict[str, Any] = {
            "knobs": knobs, "slo": {k: v for k, v in slo.items() if v is not None},
            "slo_text": SLO.from_dict(slo).words(), "workload": workload, "objective": objective, "model": model,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "study": {"name": study_name, "storage": storage, "trials": trials},
            **capacity, "evidence": evidence or {}, "vllm_serve": vllm, "report": str(report)}
        _write_yaml(path, doc)
        return
    if tuned is None:
        raise ValueError("a goodput tuned.yaml needs the tuned trial (or a capacity section)")
    doc = {
        "knobs": knobs,
        "slo": {k: v for k, v in slo.items() if v is not None},
        "slo_text": SLO.from_dict(slo).words(),
        "workload": workload,
        "rate_rps": rate,
        "rate_reason": rate_reason,
        "objective": objective,
        "model": model,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "study": {"name": study_name, "storage": storage, "trials": trials, "best_trial": tuned.number},
        "tuned": {"trial": tuned.number, "value": tuned.values[0],
                  **measurement(TrialRecord.from_trial(tuned).summary)},
        "tuned_remeasured": measurement(remeasured) if remeasured else None,
        "default": None if default is None else _default_section(default),
        "vllm_serve": vllm,
        "report": str(report),
    }
    _write_yaml(path, doc)


def _default_section(default: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """tuned.yaml's section on the default config's trial."""
    record = TrialRecord.from_trial(default)
    return {"trial": default.number, "value": default.values[0], "feasible": bool(record.feasible),
            "reason": record.reason, "knobs": record.knobs, **measurement(record.summary)}


def _write_yaml(path: Path, doc: dict[str, Any]) -> None:
    header = ("# Written by `tune`. Serve it with: slotune serve --config " + path.name + "\n"
              "# (only the `knobs` section is read; the rest is the evidence: SLO, workload, rate, measurements)\n")
    path.write_text(header + yaml.dump(doc, Dumper=_PlainDumper, sort_keys=False, width=120))


class _PlainDumper(yaml.SafeDumper):
    """Writes a repeated value out again instead of as a YAML alias (&id001 / *id001): a reader sees every figure."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def write_report(path: Path, study: optuna.Study, slo: dict[str, Any], title: str,
                 lines: list[str] | None = None) -> None:
    """An HTML page: objective per trial with the best so far (feasible vs infeasible), p99 TBT against goodput with
    the SLO line, and a table of the trials."""
    import plotly.graph_objects as go  # plotly: heavy, only for the report's figures
    from plotly.subplots import make_subplots  # plotly: heavy, only for the report's figures

    trials = measured(study)
    target_ms = (slo.get("tbt_p99") or 0) * 1000
    fig = make_subplots(rows=1, cols=2, subplot_titles=("objective per trial (best feasible so far)",
                                                        "p99 TBT vs goodput"))
    best, best_x, best_y = None, [], []
    for t in sorted(trials, key=lambda t: t.number):
        if feasible(t) and (best is None or t.values[0] > best):
            best = t.values[0]
        best_x.append(t.number)
        best_y.append(best)
    for ok, color, name in ((True, "#2ca02c", "feasible"), (False, "#d62728", "infeasible")):
        sel = [t for t in trials if feasible(t) == ok]
        text = [_hover(t) for t in sel]
        fig.add_trace(go.Scatter(x=[t.number for t in sel], y=[t.values[0] for t in sel], mode="markers",
                                 marker=dict(color=color, size=10, symbol="circle" if ok else "x"), name=name,
                                 text=text, hoverinfo="text", legendgroup=name), row=1, col=1)
        fig.add_trace(go.Scatter(x=[t.values[0] for t in sel],
                                 y=[_tbt_ms(t) for t in sel],
                                 mode="markers", marker=dict(color=color, size=10, symbol="circle" if ok else "x"),
                                 name=name, text=text, hoverinfo="text", legendgroup=name, showlegend=False),
                      row=1, col=2)
    fig.add_trace(go.Scatter(x=best_x, y=best_y, mode="lines", line=dict(shape="hv", color="#1f77b4"),
                             name="best feasible so far"), row=1, col=1)
    if target_ms:
        fig.add_hline(y=target_ms, line_dash="dash", line_color="gray", row=1, col=2,
                      annotation_text=f"SLO {target_ms:g} ms")
    fig.update_xaxes(title_text="trial", row=1, col=1)
    fig.update_yaxes(title_text="objective (req/s)", row=1, col=1)
    fig.update_xaxes(title_text="goodput (req/s)", row=1, col=2)
    fig.update_yaxes(title_text="p99 TBT (ms)", row=1, col=2)
    fig.update_layout(title=title, height=520)
    rows = "".join(_row(t) for t in sorted(trials, key=lambda t: t.number))
    body = "".join(f"<pre>{_esc(line)}</pre>" if "\n" in line else f"<p>{_esc(line)}</p>" for line in (lines or []))
    html = (f"<html><head><meta charset='utf-8'><title>{_esc(title)}</title></head><body>"
            f"<h1>{_esc(title)}</h1>{body}"
            + fig.to_html(full_html=False, include_plotlyjs=True)
            + "<h2>Trials</h2><table border=1 cellspacing=0 cellpadding=3><tr><th>#</th><th>role</th><th>knobs</th>"
              "<th>objective</th><th>p99 TBT</th><th>p99 TTFT</th><th>attainment</th><th>feasible / why not</th>"
              "<th>at capacity: figures with intervals</th></tr>"
            + rows + "</table></body></html>")
    path.write_text(html, encoding="utf-8")


def _esc(s: Any) -> str:
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _tbt_ms(t: optuna.trial.FrozenTrial) -> Any:
    """The trial's p99 TBT in ms (its falsy value, None or 0, as it is)."""
    tbt = (TrialRecord.from_trial(t).summary or {}).get("tbt_p99", None)
    return tbt and tbt * 1000


def _hover(t: optuna.trial.FrozenTrial) -> str:
    record = TrialRecord.from_trial(t)
    s = record.summary or {}
    return (f"#{t.number} {short_knobs(record.knobs if record.knobs is not None else {})}<br>value "
            f"{t.values[0]:.3f}<br>p99 TBT {format_duration(s.get('tbt_p99'))}<br>{record.reason or 'feasible'}")


def _row(t: optuna.trial.FrozenTrial) -> str:
    record = TrialRecord.from_trial(t)
    s = record.summary or {}
    att = s.get("attainment")
    cap = record.capacity or {}
    cells = [t.number, record.role_or_search, short_knobs(record.knobs if record.knobs is not None else {}),
             cap.get("describe") or f"{t.values[0]:.3f}", format_duration(s.get("tbt_p99")),
             format_duration(s.get("ttft_p99")), "-" if att is None else f"{att:.0%}",
             "yes" if feasible(t) else record.reason, cap.get("at_capacity") or ""]
    return "<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in cells) + "</tr>"


__all__ = ["write_tuned_yaml", "write_report", "write_vllm", "vllm_command", "measurement"]
