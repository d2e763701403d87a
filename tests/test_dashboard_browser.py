"""The dashboard in headless Chromium (Debian's chromium + chromium-driver at /usr/bin): every page loads without
console errors, its graphs hold the expected points (read from the plotly graph divs), the Live page follows a
real `slotune serve` engine, and a full-page screenshot of each page is saved to build/screenshots/ (untracked).

One engine, one `slotune dashboard` process and one browser serve the whole module. Set SLOTUNE_SKIP_BROWSER=1 to
skip these tests on a machine without Chromium (the README's test command installs it)."""

from __future__ import annotations

import json
import time
import re
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from dashboards.analysis import pareto_front
from dashboards.screenshots import full_page_screenshot
from tests.browser_helpers import headless_browser, skip_without_browser, start_dashboard, wait_for
from dashboards.study import load_study
from slotune import result_files as files
from tests import dashboard_data as data
from tests.server_helpers import REPO, SubprocessServer

SCREENSHOTS = REPO / "build" / "screenshots"  # untracked; docs/dashboard.md shows real runs (docs/screenshots)
TOKEN = "dashboard-test-token"
N_TRIALS = 12

skip_without_browser()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("results")
    data.write_sweep(root / "sweep-max_num_seqs")
    (root / "sweep-old").mkdir()
    (root / "sweep-old" / "sweep.json").write_text(json.dumps({"knob": "max_num_seqs", "points": []}))
    data.write_capacity_study(f"sqlite:///{root / 'study.db'}")  # first: /study opens the latest study
    data.write_study(f"sqlite:///{root / 'study.db'}", n_trials=N_TRIALS, trial_root=root / "study-trials")
    return root


@pytest.fixture(scope="module")
def engine() -> Iterator[SubprocessServer]:
    server = SubprocessServer(args=["--admin-token", TOKEN, "--max-num-seqs", "8"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def dashboard(results: Path, engine: SubprocessServer) -> Iterator[str]:
    log = open(results / "dashboard.log", "wb")
    proc, url = start_dashboard("--results", str(results), "--storage", f"sqlite:///{results / 'study.db'}",
                                "--engine-url", engine.url, "--admin-token", TOKEN, "--poll-interval", "1",
                                log=log, log_path=results / "dashboard.log")
    yield url
    proc.terminate()
    proc.wait(20)
    log.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from headless_browser()


# Reading the page ------------------------------------------------------------------------------------------------


def graph_points(browser: Any, graph_id: str) -> dict[str, int] | None:
    """{trace name: number of points} of a dcc.Graph, read from the plotly div in the page."""
    # numpy arrays arrive as base64 typed arrays ({dtype, bdata}): their length is bytes / item size
    return browser.execute_script(
        "const g = document.querySelector('#' + CSS.escape(arguments[0]) + ' .js-plotly-plot');"
        "if (!g || !g.data) return null;"
        "const size = {f8: 8, f4: 4, i4: 4, u4: 4, i2: 2, u2: 2, i1: 1, u1: 1};"
        "const n = a => !a ? 0 : (a.bdata !== undefined ? atob(a.bdata).length / size[a.dtype] : a.length);"
        "const out = {}; g.data.forEach(t => { out[t.name] = n(t.x); }); return out;", graph_id)


def text_of(browser: Any, element_id: str) -> str:
    return browser.execute_script("const e = document.getElementById(arguments[0]); return e ? e.innerText : ''",
                                  element_id)


def table_rows(browser: Any, table_id: str) -> int:
    return int(browser.execute_script(
        "const t = document.getElementById(arguments[0]); return t ? t.tBodies[0].rows.length : -1", table_id))


def console_errors(browser: Any) -> list[dict[str, Any]]:
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def open_page(browser: Any, url: str, ready: Callable[[], Any], what: str) -> Any:
    browser.get_log("browser")  # drop the previous page's messages
    browser.get(url)
    return wait_for(ready, what)


def screenshot(browser: Any, name: str) -> Path:
    """A full-page screenshot in build/screenshots/NAME.png."""
    return full_page_screenshot(browser, SCREENSHOTS / f"{name}.png")


# The pages -------------------------------------------------------------------------------------------------------
def test_curves_page_draws_the_sweep_with_slo_and_knee(browser: Any, dashboard: str) -> None:
    points = open_page(browser, dashboard + "/curves?sweep=sweep-max_num_seqs",
                       lambda: graph_points(browser, "curves-graph"), "the sweep curves")
    n = len(data.SWEEP_VALUES)
    assert points == {"output_tokens_per_s": n, "knee": 1, "goodput_rps": n, "tbt_p99": n, "ttft_p99": n}
    assert table_rows(browser, "curves-table") == n
    assert f"knee at max_num_seqs={data.KNEE_VALUE}" in text_of(browser, "curves-graph")
    assert console_errors(browser) == []
    screenshot(browser, "curves")
    # each point links to its trial's detail page
    browser.find_elements("link text", "details")[0].click()
    wait_for(lambda: graph_points(browser, "trial-steps"), "the first point's trial page")
    assert "max_num_seqs=4" in text_of(browser, "trial-info")
    assert console_errors(browser) == []


def test_curves_page_reports_an_older_results_folder(browser: Any, dashboard: str) -> None:
    message = open_page(browser, dashboard + "/curves?sweep=sweep-old", lambda: text_of(browser, "curves-error"),
                        "the format error")
    assert "older format" in message and "slotune-sweep/1" in message
    assert graph_points(browser, "curves-graph") is None
    assert console_errors(browser) == []


def test_study_page_history_pareto_importance_and_trial_links(browser: Any, dashboard: str, results: Path) -> None:
    history = open_page(browser, dashboard + "/study", lambda: graph_points(browser, "study-history"),
                        "the study history")
    study = load_study(f"sqlite:///{results / 'study.db'}")
    n_feasible = sum(r.feasible for r in study.rows)
    assert 0 < n_feasible < N_TRIALS
    assert history == {"feasible": n_feasible, "infeasible": N_TRIALS - n_feasible, "best so far": N_TRIALS}
    front = pareto_front([r.throughput for r in study.rows], [r.tbt_p99 for r in study.rows])
    assert graph_points(browser, "study-pareto") == {"feasible": n_feasible, "infeasible": N_TRIALS - n_feasible,
                                                     "Pareto front": len(front)}
    assert browser.execute_script(
        "return document.querySelector('#study-importance .js-plotly-plot').data[0].y") == ["chunk_size",
                                                                                            "max_num_seqs"]
    assert table_rows(browser, "study-table") == N_TRIALS
    assert console_errors(browser) == []
    screenshot(browser, "study")

    # the table links to each trial's detail page
    browser.find_element("link text", "trial 3").click()
    requests = wait_for(lambda: graph_points(browser, "trial-requests"), "the trial detail page")
    assert requests["TTFT"] == 10 and requests["each request's p99"] == 10
    assert "study-trials/trial-0003" in text_of(browser, "trial-info")
    assert console_errors(browser) == []


def test_capacity_study_page_draws_brackets_and_the_knobs_as_run(browser: Any, dashboard: str) -> None:
    history = open_page(browser, dashboard + "/study?name=capacity", lambda: graph_points(browser, "study-history"),
                        "the capacity study's history")
    assert history == {"feasible": 2, "infeasible": 1, "best so far": 3}
    drawn = browser.execute_script(
        "const g = document.querySelector('#study-history .js-plotly-plot');"
        "return [g.layout.yaxis.title.text, g.data[0].error_y.array, g.querySelectorAll('g.errorbar').length];")
    assert drawn[0] == "objective (capacity, req/s)"
    assert [round(v, 9) for v in drawn[1]] == [0.4, 0.6] and drawn[2] == 3  # one bar per trial's bracket
    info, table = text_of(browser, "study-info"), text_of(browser, "study-table")
    assert "objective: capacity" in info and "rate —" not in info
    assert "max_num_seqs=256, chunk_size=512" in table and "chunk_size=128 (sampled 64)" in table
    assert "cannot rank 2 parameters" in browser.execute_script(
        "return document.querySelector('#study-importance .js-plotly-plot').layout.annotations[0].text"
    ).replace("<br>", " ")
    assert console_errors(browser) == []
    screenshot(browser, "study-capacity")


def test_trial_page_shows_request_distributions_and_step_timeline(browser: Any, dashboard: str, results: Path
                                                                    ) -> None:
    from urllib.parse import quote

    folder = results / "sweep-max_num_seqs" / "max_num_seqs=16"
    requests = open_page(browser, dashboard + "/trial?dir=" + quote(str(folder), safe=""),
                         lambda: graph_points(browser, "trial-requests"), "the trial page")
    assert requests["TTFT"] == 20
    steps = graph_points(browser, "trial-steps")
    assert steps is not None and set(steps.values()) == {150} and len(steps) == 8
    assert console_errors(browser) == []
    screenshot(browser, "trial")


def _send_requests(url: str, n: int, stop: threading.Event) -> None:
    for i in range(n):
        if stop.is_set():
            return
        httpx.post(url + "/v1/completions", json={"prompt": f"Tell me a story number {i}", "max_tokens": 24,
                                                  "ignore_eos": True, "stream": False}, timeout=120)


def test_live_page_follows_the_engine(browser: Any, dashboard: str, engine: SubprocessServer, results: Path) -> None:
    # a tune run measuring: its progress file in its trials folder under the results folder
    progress = results / "tuned-trials" / "live-study" / files.PROGRESS
    progress.parent.mkdir(parents=True, exist_ok=True)
    progress.write_text(json.dumps({"updated": time.time(), "text": "measuring seqs=6 at 2.5 req/s: 21 of 48s"}))

    def seen() -> int | None:
        m = re.match(r"(\d+) steps seen", text_of(browser, "live-step-count"))
        return int(m.group(1)) if m else None

    before = open_page(browser, dashboard + "/live", lambda: seen() is not None and (seen(),), "the first poll")[0]
    generation = int(re.search(r"generation (\d+)", text_of(browser, "live-generation")).group(1))
    assert "tune (live-study)" in text_of(browser, "live-tune") and "measuring seqs=6" in text_of(browser, "live-tune")
    assert "max_num_seqs" in text_of(browser, "live-knob-table")

    stop = threading.Event()
    senders = [threading.Thread(target=_send_requests, args=(engine.url, 3, stop)) for _ in range(2)]
    for t in senders:
        t.start()
    try:
        wait_for(lambda: (seen() or 0) >= before + 20, "new engine steps on the Live page")
        steps = wait_for(lambda: (p := graph_points(browser, "live-steps")) and p.get("step time", 0) >= 20 and p,
                         "the step timeline")
        assert steps["prefill tokens"] == steps["decode tokens"] == steps["step time"]
    finally:
        for t in senders:
            t.join(120)
    # the TBT distribution comes from /metrics' inter-token latency histogram
    wait_for(lambda: browser.execute_script(
        "const g = document.querySelector('#live-tbt .js-plotly-plot');"
        "return g && g.data.length && g.data[0].y && g.data[0].y.reduce((a, b) => a + b, 0) > 0"),
        "a non-empty TBT histogram")
    # a live knob change shows up with its new generation
    r = httpx.patch(engine.url + "/admin/config", json={"max_num_seqs": 4},
                    headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200
    wait_for(lambda: f"generation {generation + 1}" in text_of(browser, "live-generation"), "the new generation")
    assert re.search(r"max_num_seqs\s+4\b", text_of(browser, "live-knob-table"))
    assert console_errors(browser) == []
    screenshot(browser, "live")


def test_live_feed_fetches_only_the_recent_and_new_steps(engine: SubprocessServer) -> None:
    from dashboards.engine_client import EngineClient, LiveFeed

    httpx.post(engine.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 12, "ignore_eos": True},
               timeout=120)
    feed = LiveFeed(EngineClient(engine.url, TOKEN), keep=5)
    first = feed.poll()
    last = httpx.get(engine.url + "/health", timeout=30).json()["last_step"]
    assert [s["step"] for s in first.steps] == list(range(last - 4, last + 1))  # the last 5, not the whole buffer
    httpx.post(engine.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
               timeout=120)
    second = feed.poll()
    assert second.steps[-1]["step"] > last and len(second.steps) == 5
    assert second.total_steps_seen == 5 + (second.steps[-1]["step"] - last)
    config = httpx.get(engine.url + "/admin/config", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    assert first.knobs_source == "admin" and first.knobs == config["config"]
    assert first.generation == config["generation"]
