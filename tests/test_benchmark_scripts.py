"""Every benchmark script parses its own command line: a script that fails at `--help` (a duplicated option after a
merge, an import that moved) would only be found by the next long benchmark run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=[path.stem for path in BENCHMARKS])
def test_script_answers_help(script: Path) -> None:
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                          cwd=script.parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
