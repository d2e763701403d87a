"""What the import contract (`lint-imports`, pyproject.toml) cannot see: the modules a process really loads,
third-party imports and lazy imports included. The tuner's, the dashboard's and the load generator's library
processes never load torch, locust or gevent, and of the engine only its torch-free knob schema, metric names and
config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import dashboard_data as data
from tests.server_helpers import REPO

TORCH_FREE_ENGINE = {"engine", "engine.knobs", "engine.metric_names", "engine.config", "engine.sampling_params"}


def loaded_after(code: str) -> dict[str, list[str]]:
    probe = (f"import json, sys\n{code}\n"
             "mods = sorted(sys.modules)\n"
             "print(json.dumps({'banned': [m for m in mods if m.split('.')[0] in ('torch', 'locust', 'gevent')],"
             " 'engine': [m for m in mods if m.split('.')[0] == 'engine']}))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("code", [
    "import tuner.commands.tune, tuner.commands.session, tuner.commands.sweep, tuner.search.study, "
    "tuner.trials.trial_runner, tuner.output",
    "import loadtest.summary, loadtest.records, loadtest.schedule, loadtest.runner, slotune.units",
    "import policies; policies.load_policy()",
])
def test_library_processes_load_neither_torch_nor_locust(code: str) -> None:
    loaded = loaded_after(code)
    assert loaded["banned"] == []
    assert set(loaded["engine"]) <= TORCH_FREE_ENGINE


def test_the_dashboard_loads_neither_the_engine_nor_torch(tmp_path: Path) -> None:
    url = f"journal:{tmp_path / 'study.journal'}"
    data.write_study(url, n_trials=3)
    loaded = loaded_after("from dashboards.app import create_app, DashboardSettings, study_body\n"
                          f"create_app(DashboardSettings()); study_body(DashboardSettings(storage={url!r}), 'tune')")
    assert loaded["banned"] == []
    assert set(loaded["engine"]) <= TORCH_FREE_ENGINE
