"""Writes slotune's Grafana dashboards (deploy/grafana/dashboards/*.json) from the panel lists below:
``python deploy/grafana/generate_dashboards.py``. The JSON files are what Grafana provisions; a test checks that they
equal this script's output, and runs every PromQL expression in them against a real Prometheus.

Template variables: ``$instance`` (engine replicas, regex), ``$slo_tbt`` (the TBT target, one of the engine's latency
bucket boundaries as Prometheus labels them). ``$__rate_interval`` is Grafana's own (the datasource's scrape interval
is set in provisioning).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DASHBOARDS_DIR = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}  # the uid provisioning gives the datasource
ENGINE = 'job="slotune-engine",instance=~"$instance"'
RATE = "[$__rate_interval]"
# TBT targets offered by $slo_tbt: bucket boundaries of slotune_request_itl_p99_seconds, spelled as the engine's
# exposition spells its `le` labels.
SLO_TBT_TARGETS = ("0.01", "0.015", "0.02", "0.025", "0.03", "0.04", "0.05", "0.06", "0.075", "0.1", "0.15", "0.2",
                   "0.3", "0.5", "1.0")
DEFAULT_SLO_TBT = "0.05"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""
    width: int = 12
    max_value: float | None = None


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    rows: tuple[tuple[str, tuple[Panel, ...]], ...]
    annotations: tuple[dict[str, Any], ...] = field(default_factory=tuple)


def quantile(q: str, metric: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{ENGINE}}}{RATE})))"


def mean(metric: str) -> str:
    return f"sum(rate({metric}_sum{{{ENGINE}}}{RATE})) / sum(rate({metric}_count{{{ENGINE}}}{RATE}))"


LENGTHS_DESCRIPTION = ("Lengths of the requests that finished on stop or length, from the engine's per-request "
                       "histogram (buckets 1, 2, 5, 10, 20, 50, ... 20000 tokens; percentiles interpolate within a "
                       "bucket). The controller's drift trigger compares these distributions, bucket by bucket, "
                       "between the window after its last move and the recent one.")


def attainment(metric: str, target: str) -> str:
    return (f'sum(rate({metric}_bucket{{{ENGINE},le="{target}"}}{RATE})) / '
            f"sum(rate({metric}_count{{{ENGINE}}}{RATE}))")


ANNOTATIONS = (
    {"name": "knob changes (config generation)", "expr": f"changes(slotune_config_generation{{{ENGINE}}}[1m]) > 0",
     "iconColor": "blue", "titleFormat": "config generation", "textFormat": "{{instance}}: new knobs applied"},
    {"name": "controller decisions", "expr": "sum by (outcome) (increase(slotune_controller_decisions_total[1m])) > 0",
     "iconColor": "orange", "titleFormat": "controller: {{outcome}}", "textFormat": "controller decision"},
    {"name": "controller rollbacks", "expr": "increase(slotune_controller_rollbacks_total[1m]) > 0",
     "iconColor": "red", "titleFormat": "controller rollback", "textFormat": "canary rolled back"},
)

OVERVIEW = Dashboard("slotune-overview", "slotune / overview", rows=(
    ("Traffic", (
        Panel("Requests/s", (
            Query(f'sum by (instance) (rate(slotune_request_success_total{{{ENGINE},finished_reason=~"stop|length"}}'
                  f"{RATE}))", "{{instance}} finished"),
            Query(f'sum(rate(slotune_request_success_total{{{ENGINE},finished_reason="abort"}}{RATE}))', "aborted"),
        ), unit="reqps"),
        Panel("Tokens/s", (
            Query(f"sum(rate(slotune_generation_tokens_total{{{ENGINE}}}{RATE}))", "generated"),
            Query(f"sum(rate(slotune_prompt_tokens_total{{{ENGINE}}}{RATE}))", "prompt"),
        ), unit="short"),
    )),
    ("Workload shape (finished requests)", (
        Panel("Prompt length per request (tokens)", (
            Query(quantile("0.5", "slotune_request_prompt_tokens"), "p50"),
            Query(quantile("0.9", "slotune_request_prompt_tokens"), "p90"),
            Query(quantile("0.99", "slotune_request_prompt_tokens"), "p99"),
            Query(mean("slotune_request_prompt_tokens"), "mean"),
        ), unit="short", description=LENGTHS_DESCRIPTION),
        Panel("Output length per request (tokens)", (
            Query(quantile("0.5", "slotune_request_generation_tokens"), "p50"),
            Query(quantile("0.9", "slotune_request_generation_tokens"), "p90"),
            Query(quantile("0.99", "slotune_request_generation_tokens"), "p99"),
            Query(mean("slotune_request_generation_tokens"), "mean"),
        ), unit="short", description=LENGTHS_DESCRIPTION),
    )),
    ("Latency against the SLO", (
        Panel("Time to first token", (
            Query(quantile("0.5", "slotune_time_to_first_token_seconds"), "p50"),
            Query(quantile("0.99", "slotune_time_to_first_token_seconds"), "p99"),
        ), unit="s"),
        Panel("Inter-token latency (TBT)", (
            Query(quantile("0.5", "slotune_inter_token_latency_seconds"), "p50"),
            Query(quantile("0.99", "slotune_inter_token_latency_seconds"), "p99"),
            Query("vector($slo_tbt)", "target"),
        ), unit="s"),
        Panel("SLO attainment (own p99 TBT <= $slo_tbt s)", (
            Query(attainment("slotune_request_itl_p99_seconds", "$slo_tbt"), "attainment"),
            Query('job_le:slotune_tbt_attainment:ratio_rate5m{le="$slo_tbt"}', "attainment, 5m (recorded)"),
            Query("vector(0.9)", "objective"),
        ), unit="percentunit", max_value=1.0,
            description="Share of finished requests whose own p99 inter-token gap is within the target (a "
                        "request attains when its own p99 gap <= the TBT target)."),
        Panel("Goodput (attaining requests/s)", (
            Query(f'sum(rate(slotune_request_itl_p99_seconds_bucket{{{ENGINE},le="$slo_tbt"}}{RATE}))', "goodput"),
            Query("job:slotune_goodput_requests:rate5m", "goodput at 50 ms, 5m (recorded)"),
        ), unit="reqps"),
        Panel("SLO burn rate (50 ms target, 10 % budget; alerts at 5x and 2x)", (
            Query("job:slotune_slo_burn_rate:rate5m", "5m"),
            Query("job:slotune_slo_burn_rate:rate1h", "1h"),
        ), unit="short"),
    )),
    ("Errors", (
        Panel("HTTP errors/s by code", (
            Query(f'sum by (code) (rate(slotune_http_responses_total{{{ENGINE},code=~"4..|5.."}}{RATE}))',
                  "{{code}}"),
        ), unit="reqps"),
        Panel("Replicas up", (Query(f"up{{{ENGINE}}}", "{{instance}}"),), unit="short"),
    )),
    ("Controller", (
        Panel("Controller decisions/s by outcome", (
            Query(f"sum by (outcome) (rate(slotune_controller_decisions_total{RATE}))", "{{outcome}}"),
            Query(f"sum(rate(slotune_controller_rollbacks_total{RATE}))", "rollbacks"),
        ), unit="short"),
        Panel("Controller state", (
            Query("slotune_controller_last_attainment", "last attainment"),
            Query("slotune_controller_canary_in_progress", "canary in progress"),
        ), unit="short"),
    )),
), annotations=ANNOTATIONS)

SCHEDULER = Dashboard("slotune-scheduler", "slotune / scheduler", rows=(
    ("Batch composition", (
        Panel("Tokens per step", (
            Query(f"instance:slotune_step_prefill_tokens:mean_rate1m{{{ENGINE}}}", "{{instance}} prefill"),
            Query(f"instance:slotune_step_decode_tokens:mean_rate1m{{{ENGINE}}}", "{{instance}} decode"),
        )),
        Panel("Token budget used (share of max_num_batched_tokens)", (
            Query(f"instance:slotune_token_budget_used:ratio_rate1m{{{ENGINE}}}", "{{instance}}"),
        ), unit="percentunit", max_value=1.0),
        Panel("Steps/s and step time p99", (
            Query(f"instance:slotune_steps:rate1m{{{ENGINE}}}", "{{instance}} steps/s"),
            Query(f"instance:slotune_step_duration_seconds:p99_rate1m{{{ENGINE}}}", "{{instance}} p99 step (s)"),
        )),
        Panel("Knobs", (Query(f"slotune_knob{{{ENGINE}}}", "{{instance}} {{name}}"),
                        Query(f"slotune_config_generation{{{ENGINE}}}", "{{instance}} generation"))),
    )),
    ("Queues and KV cache", (
        Panel("Running / waiting / preempted", (
            Query(f"slotune_num_requests_running{{{ENGINE}}}", "{{instance}} running"),
            Query(f"slotune_num_requests_waiting{{{ENGINE}}}", "{{instance}} waiting"),
            Query(f"slotune_num_requests_preempted{{{ENGINE}}}", "{{instance}} preempted"),
        )),
        Panel("KV cache usage", (Query(f"slotune_kv_cache_usage_ratio{{{ENGINE}}}", "{{instance}}"),),
              unit="percentunit", max_value=1.0),
        Panel("Prefix cache hit ratio", (
            Query(f"instance:slotune_prefix_cache_hit:ratio_rate1m{{{ENGINE}}}", "{{instance}}"),
        ), unit="percentunit", max_value=1.0),
        Panel("Preemptions/s", (Query(f"instance:slotune_preemptions:rate1m{{{ENGINE}}}", "{{instance}}"),)),
    )),
), annotations=ANNOTATIONS)

DASHBOARDS = (OVERVIEW, SCHEDULER)


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit, "min": 0}
    if panel.max_value is not None:
        defaults["max"] = panel.max_value
    return {
        "id": panel_id, "type": "timeseries", "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE, "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [{"datasource": DATASOURCE, "expr": q.expr, "legendFormat": q.legend or "__auto",
                     "refId": chr(ord("A") + i)} for i, q in enumerate(panel.queries)],
    }


def _templating() -> dict[str, Any]:
    instances = 'label_values(up{job="slotune-engine"}, instance)'
    return {"list": [
        {"name": "instance", "label": "engine replica", "type": "query", "datasource": DATASOURCE,
         "definition": instances, "query": {"query": instances, "refId": "instances"}, "refresh": 2,
         "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}},
        {"name": "slo_tbt", "label": "TBT target (s)", "type": "custom", "query": ",".join(SLO_TBT_TARGETS),
         "current": {"text": DEFAULT_SLO_TBT, "value": DEFAULT_SLO_TBT},
         "options": [{"text": t, "value": t, "selected": t == DEFAULT_SLO_TBT} for t in SLO_TBT_TARGETS]},
    ]}


def dashboard_json(dashboard: Dashboard) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y, panel_id = 0, 1
    for row_title, row_panels in dashboard.rows:
        panels.append({"id": panel_id, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id, y, x = panel_id + 1, y + 1, 0
        for panel in row_panels:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(_panel_json(panel, panel_id, x, y))
            panel_id, x = panel_id + 1, x + panel.width
        y += 8
    annotations = [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
                    "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
                    "type": "dashboard"}]
    annotations += [{"datasource": DATASOURCE, "enable": True, "step": "15s", **a} for a in dashboard.annotations]
    return {"uid": dashboard.uid, "title": dashboard.title, "tags": ["slotune"], "editable": True,
            "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
            "timepicker": {}, "timezone": "", "graphTooltip": 1, "annotations": {"list": annotations},
            "templating": _templating(), "panels": panels}


def rendered() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"{d.uid.removeprefix('slotune-')}.json": json.dumps(dashboard_json(d), indent=2) + "\n"
            for d in DASHBOARDS}


def main() -> int:
    DASHBOARDS_DIR.mkdir(exist_ok=True)
    for name, text in rendered().items():
        (DASHBOARDS_DIR / name).write_text(text)
        print(f"wrote {DASHBOARDS_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
