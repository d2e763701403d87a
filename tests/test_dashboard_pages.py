"""The dashboard's pages without a browser: empty states (no study, engine unreachable, an older results folder)
and the `slotune dashboard` flag errors. The pages themselves are tested in Chromium in test_dashboard_browser."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from dashboards.app import (DashboardSettings, curves_page, live_page, live_update, study_body, study_page, sweep_body,
                            trial_page)
from dashboards.engine_client import EngineClient, LiveFeed
from tests import dashboard_data as data
from tests.server_helpers import free_port


def texts(component: Any) -> list[str]:
    """Every string in a Dash component tree."""
    if isinstance(component, str):
        return [component]
    if isinstance(component, (list, tuple)):
        return [t for c in component for t in texts(c)]
    children = getattr(component, "children", None)
    return texts(children) if children is not None else []


def find(component: Any, id_: str) -> Any:
    """The component with id ``id_`` in a component tree (None: none)."""
    if isinstance(component, (list, tuple)):
        return next((found for c in component if (found := find(c, id_)) is not None), None)
    if getattr(component, "id", None) == id_:
        return component
    children = getattr(component, "children", None)
    return find(children, id_) if children is not None and not isinstance(children, str) else None


def table_cells(component: Any, id_: str) -> tuple[list[str], list[list[Any]]]:
    """(header, rows of cells) of the table ``id_``."""
    head, body = find(component, id_).children
    return ([th.children for th in head.children.children],
            [[td.children for td in tr.children] for tr in body.children])


def notices(component: Any) -> dict[str, str]:
    """{id: text} of the notice boxes in a component tree."""
    found: dict[str, str] = {}

    def walk(c: Any) -> None:
        if isinstance(c, (list, tuple)):
            for x in c:
                walk(x)
            return
        if "notice" in str(getattr(c, "className", "")):
            found[c.id] = " ".join(texts(c))
        children = getattr(c, "children", None)
        if children is not None and not isinstance(children, str):
            walk(children)

    walk(component)
    return found


def test_pages_without_sources_say_which_flag_to_pass() -> None:
    empty = DashboardSettings()
    assert "--results" in notices(curves_page(empty, {}))["curves-empty"]
    assert "no study yet" in notices(study_page(empty, {}))["study-empty"]
    assert "--engine-url" in notices(live_page(empty))["live-empty"]
    assert "no trial chosen" in notices(trial_page(empty, {}))["trial-empty"]


def test_empty_results_folder_and_missing_storage(tmp_path: Path) -> None:
    settings = DashboardSettings(results=tmp_path, storage=f"sqlite:///{tmp_path / 'missing.db'}")
    assert "no sweep yet" in notices(curves_page(settings, {}))["curves-empty"]
    assert "does not exist" in notices(study_page(settings, {}))["study-empty"]
    assert not (tmp_path / "missing.db").exists()


def test_older_sweep_folder_is_reported_not_drawn(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "sweep.json").write_text(json.dumps({"knob": "max_num_seqs", "points": []}))
    found = notices(sweep_body(DashboardSettings(results=tmp_path), "old"))
    assert "an older format" in found["curves-error"] and "slotune-sweep/1" in found["curves-error"]


def test_sweep_outside_the_results_folder_is_refused(tmp_path: Path) -> None:
    data.write_sweep(tmp_path / "elsewhere")
    (tmp_path / "results").mkdir()
    found = notices(sweep_body(DashboardSettings(results=tmp_path / "results"), "../elsewhere"))
    assert "outside the results folder" in found["curves-error"]


def test_unreachable_engine_is_an_empty_state_not_an_error() -> None:
    feed = LiveFeed(EngineClient(f"http://127.0.0.1:{free_port()}"))
    steps_fig, tbt_fig, status, knobs = live_update(feed)
    assert "engine unreachable" in steps_fig.layout.annotations[0].text
    assert "unreachable" in notices(status)["live-error"]


def test_dashboard_flag_errors_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dashboards.cli import main

    for args, message in ((["--results", str(tmp_path / "nope")], "--results:"),
                          (["--engine-url", "localhost:8000"], "--engine-url:"),
                          (["--port", "70000"], "--port:"),
                          (["--poll-interval", "0"], "--poll-interval:")):
        assert main(args) == 2  # before any server starts
        assert message in capsys.readouterr().err


def test_the_study_page_shows_a_capacity_trial_with_its_bracket_and_intervals() -> None:
    from dashboards.study import evidence_text

    attrs = {"capacity": {"describe": "capacity 2.1 req/s (bracket 2.1-2.4, 4 probes), 180 output tok/s",
                          "at_capacity": "attainment 94% (88-98%) met, p99 TBT 41ms (38-45) met"}}
    text = evidence_text(attrs)
    assert text.startswith("capacity 2.1 req/s (bracket 2.1-2.4") and "at it: attainment 94% (88-98%) met" in text
    assert evidence_text({"summary": {}}) == ""


def test_the_study_table_shows_each_trials_knobs_as_the_engine_ran_them(tmp_path: Path) -> None:
    url = f"journal:{tmp_path / 'study.journal'}"
    data.write_capacity_study(url)
    header, rows = table_cells(study_body(DashboardSettings(storage=url), "capacity"), "study-table")
    knobs = [row[header.index("knobs as run")] for row in rows]
    # the default config's row: its knobs (those the study searched); the repaired trial: chunk_size as run
    assert knobs == ["max_num_seqs=256, chunk_size=512", "max_num_seqs=8, chunk_size=128 (sampled 64)",
                     "max_num_seqs=64, chunk_size=256"]
    assert "capacity req/s" in header
    from dashboards.study import knobs_text, load_study

    running = dataclasses.replace(load_study(url).rows[1], knobs={})  # not measured yet: only what was sampled
    assert knobs_text(running, ["max_num_seqs", "chunk_size"]) == "max_num_seqs=8, chunk_size=64 (sampled; not measured)"


def test_the_study_header_says_what_the_objective_is_measured_at(tmp_path: Path) -> None:
    url = f"journal:{tmp_path / 'study.journal'}"
    data.write_capacity_study(url)
    data.write_study(url, n_trials=2)
    capacity = " ".join(texts(find(study_body(DashboardSettings(storage=url), "capacity"), "study-info")))
    assert "rate" not in capacity.replace("arrival rate", "") and "—" not in capacity
    assert "objective: capacity, the highest arrival rate served within the SLO (maximize), searched per trial" \
        in capacity
    goodput = " ".join(texts(find(study_body(DashboardSettings(storage=url), "tune"), "study-info")))
    assert "objective: goodput at 4 req/s (maximize)" in goodput


def test_the_live_page_says_what_the_newest_tune_is_measuring(tmp_path: Path) -> None:
    """A tune run writes its live progress into its trials folder; the live page shows the newest one's under the
    results folder, and says when it has gone quiet."""
    import os
    import time

    from dashboards.app import tune_status
    from slotune import result_files as files

    assert tune_status(tmp_path, time.time()) == "" and tune_status(None, time.time()) == ""
    now = time.time()
    for name, text, age in (("old-study", "measuring seqs=2 at 1 req/s", 600.0),
                            ("new-study", "measuring seqs=6 at 2.5 req/s: 21 of 48s of load", 3.0)):
        folder = tmp_path / "tuned-trials" / name
        folder.mkdir(parents=True)
        (folder / files.PROGRESS).write_text(json.dumps({"updated": now - age, "text": text}))
        os.utime(folder / files.PROGRESS, (now - age, now - age))
    shown = tune_status(tmp_path, now)
    assert shown == "tune (new-study), 3 s ago: measuring seqs=6 at 2.5 req/s: 21 of 48s of load", shown
    assert "not measuring now" in tune_status(tmp_path, now + 60)
