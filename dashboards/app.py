"""The Dash app of `slotune dashboard`: pages Curves (/curves), Study (/study), Live (/live), Trial detail
(/trial?dir=FOLDER) and Controller (/controller, from `slotune control`'s decision log). Callbacks load data (dashboards.results / .study / .engine_client) and call the figure
functions of dashboards.figures; every page says plainly when there is nothing to show and why."""

from __future__ import annotations

import datetime as dt
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

from dash import Dash, Input, Output, dcc, html

from dashboards import figures
from dashboards.controller_figure import controller_figure, decision_rows
from dashboards.engine_client import EngineClient, EngineUnreachable, LiveFeed
from dashboards.results import (FormatError, find_folders, in_window, latest_tune_progress, load_sweep, load_trial,
                                read_request_records, read_steps, workload_name)
from dashboards.study import (StudyData, StudyUnavailable, TrialRow, knobs_text, load_study, open_storage,
                              searched_names, study_names)
from slotune import result_files as files
from tuner.search.trial_record import StudyRecord

PAGES = [("/curves", "Curves"), ("/study", "Study"), ("/live", "Live"), ("/trial", "Trial detail"),
         ("/controller", "Controller")]
GRAPH_CONFIG: Any = {"displaylogo": False}  # dcc.Graph's config type
STUDY_REFRESH_S = 15


@dataclass(frozen=True)
class DashboardSettings:
    storage: str | None = None  # Optuna storage URL or file
    results: Path | None = None  # folder holding sweep and trial folders
    engine_url: str | None = None
    admin_token: str | None = None
    poll_interval_s: float = 2.0
    controller_log: Path | None = None  # `slotune control --log` (JSONL)


# Small building blocks ------------------------------------------------------------------------------------------
def notice(text: str, id_: str | None = None, kind: str = "empty") -> html.Div:
    """An empty-state or error message (class `empty` / `error`; tests look for them)."""
    return html.Div(text, id=id_ or f"{kind}-notice", className=f"notice {kind}")


def graph(id_: str, figure: Any) -> dcc.Graph:
    return dcc.Graph(id=id_, figure=figure, config=GRAPH_CONFIG)


def trial_href(folder: str | Path) -> str:
    return "/trial?dir=" + quote(str(folder), safe="")


def fmt(x: Any, scale: float = 1.0, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int) and scale == 1.0:
        return str(x)  # knob values and counts: exact
    if isinstance(x, (int, float)):
        return f"{x * scale:.{digits}g}"
    return str(x)


def table(header: list[str], rows: list[list[Any]], id_: str) -> html.Table:
    return html.Table([html.Thead(html.Tr([html.Th(h) for h in header])),
                       html.Tbody([html.Tr([html.Td(c) for c in row]) for row in rows])], id=id_, className="data")


def knob_table(knobs: dict[str, Any], id_: str) -> html.Table:
    return table(["knob", "value"], [[k, fmt(v)] for k, v in sorted(knobs.items())], id_)


# Pages ----------------------------------------------------------------------------------------------------------
def curves_page(settings: DashboardSettings, query: dict[str, str]) -> html.Div:
    if settings.results is None:
        return html.Div([html.H2("Sweep curves"),
                         notice("no results folder: start the dashboard with --results DIR (the folder that "
                                "`slotune sweep --out` writes into)", "curves-empty")])
    folders = find_folders(settings.results, "sweep.json")
    if not folders:
        return html.Div([html.H2("Sweep curves"),
                         notice(f"no sweep yet under {settings.results}: run `slotune sweep --knob max_num_seqs "
                                f"--values 4,8,16,32 --out {settings.results}/sweep-max_num_seqs`", "curves-empty")])
    names = [str(f.relative_to(settings.results)) for f in folders]
    chosen = query.get("sweep") if query.get("sweep") in names else names[-1]
    return html.Div([
        html.H2("Sweep curves"),
        dcc.Dropdown(id="sweep-select", options=[{"label": n, "value": n} for n in names], value=chosen,
                     clearable=False),
        html.Div(id="sweep-body"),
    ])


def sweep_body(settings: DashboardSettings, name: str | None) -> list[Any]:
    if settings.results is None or not name:
        return [notice("choose a sweep", "curves-empty")]
    folder = (settings.results / name).resolve()
    if settings.results.resolve() not in (folder, *folder.parents):
        return [notice(f"{name} is outside the results folder", "curves-error", "error")]
    try:
        sweep = load_sweep(folder)
    except FormatError as error:
        return [notice(f"cannot show this sweep: {error}", "curves-error", "error")]
    knee = figures.sweep_knee(sweep)
    rows = []
    for p in sweep.sorted_points():
        link: Any = html.A("details", href=trial_href(folder / p.dir)) if p.dir else "—"
        rows.append([fmt(p.value), fmt(p.metric("output_tokens_per_s")), fmt(p.metric("goodput_rps")),
                     fmt(p.metric("tbt_p99"), 1000), fmt(p.metric("ttft_p99")), fmt(p.feasible), p.reason or "",
                     "knee" if knee and p.value == knee.value else "", link])
    info = (f"workload {sweep.workload}, rate {fmt(sweep.rate)} req/s, SLO p99 TBT "
            f"{fmt(sweep.slo.get('tbt_p99'), 1000)} ms; fixed: "
            + (", ".join(f"{k}={v}" for k, v in sorted(sweep.fixed.items())) or "nothing"))
    parts: list[Any] = []
    if sweep.simulated:
        parts.append(notice("simulated: these points come from the simulator, not from the engine",
                            "curves-simulated", "warning"))
    parts += [html.P(info, className="info"), graph("curves-graph", figures.sweep_curves_figure(sweep)),
              table([sweep.knob, "tokens/s", "goodput req/s", "p99 TBT ms", "p99 TTFT s", "feasible", "reason",
                     "knee", "trial"], rows, "curves-table")]
    return parts


def study_page(settings: DashboardSettings, query: dict[str, str]) -> html.Div:
    title = html.H2("Study")
    if settings.storage is None:
        return html.Div([title, notice("no study yet: start the dashboard with --storage URL (the tuner's Optuna "
                                       "storage, e.g. sqlite:///tune-study.db)", "study-empty")])
    try:
        names = study_names(open_storage(settings.storage))
    except StudyUnavailable as error:
        return html.Div([title, notice(str(error), "study-empty")])
    if not names:
        return html.Div([title, notice(f"no study yet in {settings.storage} (run `tune`)", "study-empty")])
    chosen = query.get("name") if query.get("name") in names else names[-1]
    return html.Div([title, dcc.Dropdown(id="study-select", options=[{"label": n, "value": n} for n in names],
                                         value=chosen, clearable=False),
                     # a study that `tune` is still running grows: reread it now and then
                     dcc.Interval(id="study-refresh", interval=STUDY_REFRESH_S * 1000, n_intervals=0),
                     html.Div(id="study-body")])


def _trial_link(row: TrialRow, settings: DashboardSettings) -> Any:
    if not row.trial_dir:
        return "—"
    folder = Path(row.trial_dir)
    if not folder.is_absolute() and settings.results is not None and (settings.results / folder).exists():
        folder = settings.results / folder
    return html.A(f"trial {row.number}", href=trial_href(folder.resolve()))


def study_info(study: StudyData) -> str:
    """The study page's header: the trials, the objective and what it is measured at, the workload and the SLO."""
    asked = StudyRecord.from_attrs(study.user_attrs)
    completed = sum(r.state == "COMPLETE" for r in study.rows)
    if study.objective == "capacity":
        objective = f"capacity, the highest arrival rate served within the SLO ({study.direction}), searched per trial"
    else:
        rate = f"at {fmt(asked.rate)} req/s" if asked.rate is not None else "rate not recorded"
        objective = f"goodput {rate} ({study.direction})"
    return (f"{len(study.rows)} trials ({completed} completed, {sum(r.feasible for r in study.rows)} feasible); "
            f"objective: {objective}; workload {workload_name(asked.workload) or '?'}; "
            f"SLO p99 TBT {fmt((asked.slo or {}).get('tbt_p99'), 1000)} ms")


def study_body(settings: DashboardSettings, name: str | None) -> list[Any]:
    if settings.storage is None or not name:
        return [notice("choose a study", "study-empty")]
    try:
        study = load_study(settings.storage, name)
    except StudyUnavailable as error:
        return [notice(str(error), "study-empty")]
    slo = StudyRecord.from_attrs(study.user_attrs).slo or {}
    searched = searched_names(study.rows)
    rows = [[r.number, r.state, fmt(r.value), fmt(r.feasible), fmt(r.throughput), fmt(r.tbt_p99, 1000),
             knobs_text(r, searched), ("simulated " if r.simulated else "") + (r.reason or ""), r.evidence,
             _trial_link(r, settings)] for r in study.rows]
    return [html.P(study_info(study), className="info", id="study-info"),
            graph("study-history", figures.history_figure(study.rows, study.direction, study.objective)),
            html.Div([graph("study-pareto", figures.pareto_figure(study.rows, slo.get("tbt_p99"))),
                      graph("study-importance", figures.importance_figure(study.importances,
                                                                          study.importance_note))],
                     className="row"),
            table(["trial", "state", f"{study.objective} req/s", "feasible", "tokens/s", "p99 TBT ms", "knobs as run",
                   "reason", "capacity and intervals", "details"], rows, "study-table")]


def live_page(settings: DashboardSettings) -> html.Div:
    title = html.H2("Live engine")
    if settings.engine_url is None:
        return html.Div([title, notice("no engine: start the dashboard with --engine-url http://HOST:PORT",
                                       "live-empty")])
    return html.Div([
        title, html.P(f"engine {settings.engine_url}, polled every {settings.poll_interval_s:g} s", className="info"),
        dcc.Interval(id="live-interval", interval=int(settings.poll_interval_s * 1000), n_intervals=0),
        html.Div(id="live-status", className="info"),
        html.Div(id="live-tune", className="info"),
        html.Div([html.Div([graph("live-steps", figures.empty_figure("waiting for the first poll"))],
                           className="wide"),
                  html.Div([graph("live-tbt", figures.empty_figure("waiting for the first poll")),
                            html.H3("current knobs"), html.Div(id="live-knobs")], className="narrow")],
                 className="row"),
    ])


TUNE_IDLE_S = 30.0  # a progress file older than this: tune is not measuring now


def tune_status(results: Path | None, now: float) -> str:
    """What the newest ``tune`` under the results folder is measuring, and how long ago it said so ("" without one)."""
    found = None if results is None else latest_tune_progress(results)
    if found is None:
        return ""
    folder, data = found
    age = max(0.0, now - float(data.get("updated") or 0.0))
    when = f"{age:.0f} s ago" + (" (not measuring now)" if age > TUNE_IDLE_S else "")
    return f"tune ({folder.name}), {when}: {data.get('text') or '?'}"


def live_update(feed: LiveFeed | None) -> tuple[Any, Any, Any, Any]:
    if feed is None:
        return (figures.empty_figure("no engine"),) * 2 + ("", "")
    try:
        snap = feed.poll()
    except EngineUnreachable as error:
        message = f"engine unreachable: {error}"
        return (figures.empty_figure(message), figures.empty_figure(message),
                notice(message, "live-error", "error"), "")
    last = snap.steps[-1]["step"] if snap.steps else None
    status = (f"{snap.total_steps_seen} steps seen (showing the last {len(snap.steps)}); last step {fmt(last)}; "
              f"config generation {fmt(snap.generation)}; updated {dt.datetime.now():%H:%M:%S}")
    source = ("from GET /admin/config" if snap.knobs_source == "admin"
              else "from /metrics (numbers; give --admin-token for the exact config)")
    knobs = html.Div([html.P(f"generation {fmt(snap.generation)}, {source}", id="live-generation"),
                      knob_table(snap.knobs, "live-knob-table")]
                     + ([notice(snap.config_error, "live-config-error", "error")] if snap.config_error else []))
    return (figures.step_timeline_figure(snap.steps, wall_clock=True, title="engine steps (live)"),
            figures.itl_histogram_figure(snap.itl), html.Span(status, id="live-step-count"), knobs)


def trial_page(settings: DashboardSettings, query: dict[str, str]) -> html.Div:
    title = html.H2("Trial detail")
    folder = query.get("dir")
    if not folder:
        results = settings.results
        found = find_folders(results, files.TRIAL) if results else []
        if results is None or not found:
            return html.Div([title, notice("no trial chosen: open one from the Study or Curves page "
                                           "(or /trial?dir=FOLDER)", "trial-empty")])
        return html.Div([title, html.P("trial folders under the results folder:"),
                         html.Ul([html.Li(html.A(str(f.relative_to(results)), href=trial_href(f.resolve())))
                                  for f in found], id="trial-list")])
    try:
        trial = load_trial(folder)
        steps = read_steps(folder)
        records = in_window(read_request_records(folder), trial.summary)  # warm-up requests left out
    except FormatError as error:
        return html.Div([title, notice(f"cannot show this trial: {error}", "trial-error", "error")])
    s = trial.summary
    info = (f"{folder} — {'simulated, ' if trial.simulated else ''}{'feasible' if trial.feasible else 'infeasible'}"
            f"{': ' + trial.reason if trial.reason else ''}; workload {trial.workload}, rate {fmt(trial.rate)} req/s; "
            f"{fmt(s.get('output_tokens_per_s'))} tokens/s, goodput {fmt(s.get('goodput_rps'))} req/s, "
            f"p99 TBT {fmt(s.get('tbt_p99'), 1000)} ms, p99 TTFT {fmt(s.get('ttft_p99'))} s; started "
            f"{trial.started_at}")
    return html.Div([title, html.P(info, className="info", id="trial-info"),
                     graph("trial-requests", figures.request_distributions_figure(records, trial.slo)),
                     graph("trial-steps", figures.step_timeline_figure(steps, title="engine steps of the load test")),
                     html.Div([html.Div([html.H3("knobs"), knob_table(trial.knobs, "trial-knobs")]),
                               html.Div([html.H3("step statistics"),
                                         knob_table(trial.step_stats, "trial-step-stats")])], className="row")])


def controller_page(settings: DashboardSettings) -> html.Div:
    title = html.H2("Controller")
    if settings.controller_log is None:
        return html.Div([title, notice("no controller log: start the dashboard with --controller-log FILE (the "
                                       "file `slotune control --log` writes)", "controller-empty")])
    return html.Div([title, html.P(f"log {settings.controller_log}", className="info"),
                     dcc.Interval(id="controller-interval", interval=int(settings.poll_interval_s * 1000) * 2,
                                  n_intervals=0),
                     html.Div(id="controller-body")])


def controller_body(settings: DashboardSettings) -> list[Any]:
    from tuner.control.decision_log import read_log

    assert settings.controller_log is not None
    records = read_log(settings.controller_log)
    if not records:
        return [notice(f"{settings.controller_log} has no records yet (is `slotune control` running?)",
                       "controller-nothing")]
    targets = [r["trigger"]["evidence"].get("target") for r in records if r.get("kind") == "decision"
               and isinstance((r.get("trigger") or {}).get("evidence"), dict)]
    target = next((t for t in reversed(targets) if isinstance(t, (int, float))), None)
    rows = decision_rows(records)
    return [graph("controller-timeline", controller_figure(records, target)),
            html.H3(f"decisions ({len(rows)})"),
            table(["#", "time", "trigger", "outcome", "move", "why"], rows, "controller-decisions") if rows
            else notice("no decision yet", "controller-no-decision")]


# The app --------------------------------------------------------------------------------------------------------
def create_app(settings: DashboardSettings) -> Dash:
    app = Dash(__name__, title="slotune", suppress_callback_exceptions=True, update_title="")
    feed = (LiveFeed(EngineClient(settings.engine_url, settings.admin_token))
            if settings.engine_url is not None else None)
    app.layout = html.Div([
        dcc.Location(id="url"),
        html.Nav([html.Span("slotune", className="brand")]
                 + [dcc.Link(label, href=path, id=f"nav-{path.strip('/')}") for path, label in PAGES]),
        html.Main(id="page"),
    ])

    @app.callback(Output("page", "children"), Input("url", "pathname"), Input("url", "search"))
    def route(pathname: str | None, search: str | None) -> Any:
        query = {k: v[0] for k, v in parse_qs((search or "").lstrip("?")).items()}
        path = pathname or "/"
        if path in ("/", "/curves"):
            return curves_page(settings, query)
        if path == "/study":
            return study_page(settings, query)
        if path == "/live":
            return live_page(settings)
        if path == "/trial":
            return trial_page(settings, query)
        if path == "/controller":
            return controller_page(settings)
        return notice(f"no page {path}: the pages are " + ", ".join(p for p, _ in PAGES), "page-missing", "error")

    @app.callback(Output("sweep-body", "children"), Input("sweep-select", "value"))
    def show_sweep(name: str | None) -> Any:
        return sweep_body(settings, name)

    @app.callback(Output("study-body", "children"), Input("study-select", "value"),
                  Input("study-refresh", "n_intervals"))
    def show_study(name: str | None, _: int) -> Any:
        return study_body(settings, name)

    @app.callback(Output("live-steps", "figure"), Output("live-tbt", "figure"), Output("live-status", "children"),
                  Output("live-knobs", "children"), Output("live-tune", "children"),
                  Input("live-interval", "n_intervals"))
    def poll_engine(_: int) -> Any:
        return (*live_update(feed), tune_status(settings.results, time.time()))

    @app.callback(Output("controller-body", "children"), Input("controller-interval", "n_intervals"))
    def show_controller(_: int) -> Any:
        return controller_body(settings)

    return app
