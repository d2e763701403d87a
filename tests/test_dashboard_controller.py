"""The dashboard's Controller page in headless Chromium, on a decision log with known contents: the attainment
curve has one point per observation, each decision is marked by outcome, the decisions table has one row per
decision; without a log the page says what to pass."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dashboards.screenshots import full_page_screenshot
from tests.browser_helpers import headless_browser, skip_without_browser, start_dashboard, wait_for
from tests.server_helpers import REPO
from tuner.control.decision_log import DecisionLog

skip_without_browser()

N_OBS = 12
OUTCOMES = ["no_move", "rolled_back", "kept"]


def write_log(path: Path) -> None:
    log = DecisionLog(path)
    for i in range(N_OBS):
        value = 0.95 if i < 4 or i > 8 else 0.5
        log.write("observation", generation=1 + i // 6, knobs={"max_num_seqs": 2.0 if i < 8 else 8.0,
                                                               "max_num_batched_tokens": 64.0, "chunk_size": 32.0,
                                                               "block_size": 16.0},
                  attainment={"value": value, "low": value - 0.1, "high": min(1.0, value + 0.05), "n": 40})
        if i in (5, 6, 8):
            outcome = OUTCOMES[(5, 6, 8).index(i)]
            log.write("decision", id=(5, 6, 8).index(i) + 1, outcome=outcome, reason=f"because {outcome}",
                      trigger={"kind": "attainment", "reason": "low", "evidence": {"target": 0.9}},
                      candidate={"max_num_seqs": 8} if outcome != "no_move" else None)
        time.sleep(0.01)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from headless_browser()


def decisions_table(browser: Any) -> dict[str, Any] | None:
    return browser.execute_script(
        "const t = document.getElementById('controller-decisions');"
        "if (!t || !t.tBodies.length || !t.tBodies[0].rows.length) return null;"
        "return {rows: t.tBodies[0].rows.length, text: t.innerText};")


def trace_points(browser: Any, graph_id: str) -> dict[str, int] | None:
    return browser.execute_script(
        "const g = document.querySelector('#' + CSS.escape(arguments[0]) + ' .js-plotly-plot');"
        "if (!g || !g.data) return null; const out = {};"
        "g.data.forEach(t => { if (t.showlegend !== false) out[t.name] = (t.x || []).length; }); return out;",
        graph_id)


def test_controller_page_draws_attainment_knobs_and_decisions(browser: Any, tmp_path: Path) -> None:
    log = tmp_path / "controller.jsonl"
    write_log(log)
    proc, url = start_dashboard("--controller-log", str(log), "--poll-interval", "1")
    try:
        browser.get(url + "/controller")
        points = wait_for(lambda: trace_points(browser, "controller-timeline"), "the controller timeline")
        assert points["attainment"] == N_OBS and points["max_num_seqs"] == N_OBS
        assert {k: v for k, v in points.items() if k.startswith("decision")} == {
            f"decision: {o}": 1 for o in OUTCOMES}
        # The page redraws every poll: read the table in one script call, so no element goes stale between reads.
        table = wait_for(lambda: decisions_table(browser), "the decisions table")
        assert table["rows"] == len(OUTCOMES)
        assert "because rolled_back" in table["text"]
        assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        full_page_screenshot(browser, REPO / "build" / "screenshots" / "controller.png")
    finally:
        proc.terminate()
        proc.wait(20)


def test_controller_page_without_a_log_says_what_to_pass(browser: Any) -> None:
    proc, url = start_dashboard()
    try:
        browser.get(url + "/controller")
        text = wait_for(lambda: browser.execute_script(
            "const e = document.getElementById('controller-empty'); return e ? e.innerText : ''"), "the notice")
        assert "--controller-log" in text
    finally:
        proc.terminate()
        proc.wait(20)
