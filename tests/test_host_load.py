"""A busy machine is not a verdict: a process outside tune's own that takes a core during one config's window makes
that window void (run again), never that config's miss, on a real engine and load generator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from policies import WorkloadSpec
from slotune.slo import SLO
from tests.server_helpers import SubprocessServer
from tuner.measure.measurement import MeasurementSpec, measure
from tuner.trials.engine_handle import EngineHandle
from tuner.trials.host_load import BUSY_CORES, HostLoad, busy_reason, serving_pid
from tuner.trials.trial_runner import TrialOutcome, TrialRunner


def start_orphan_hog() -> int:
    """A busy loop that is not this process's descendant (its parent shell exits at once): another tenant."""
    out = subprocess.run(["sh", "-c", f"setsid {sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True).stdout
    pid = int(out.strip())
    assert pid not in {p.pid for p in psutil.Process().children(recursive=True)}
    return pid


def stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_host_load_counts_other_processes_and_not_this_ones_own() -> None:
    own = HostLoad().start()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    child.wait()
    mine = own.stop()
    assert float(mine["other_cores"]) < BUSY_CORES and busy_reason(mine) is None  # a child's CPU is tune's own
    hog = start_orphan_hog()
    try:
        load = HostLoad().start()
        time.sleep(1.5)
        other = load.stop()
    finally:
        stop(hog)
    assert float(other["other_cores"]) > 0.6, other
    reason = busy_reason(other)
    assert reason is not None and reason.startswith("the machine was busy")
    assert busy_reason({**other, "judged": False}) is None  # where tune cannot tell its engine apart: recorded only


class HogDuring:
    """A TrialRunner whose first ``windows`` trials run beside another tenant's busy loop."""

    def __init__(self, runner: TrialRunner, windows: int) -> None:
        self.runner, self.windows = runner, windows
        self.slo, self.simulated = runner.slo, False

    def run(self, knobs: dict[str, Any], out_dir: Path, rate: float | None = None, seed: int | None = None,
            duration: float | None = None) -> TrialOutcome:
        if self.windows <= 0:
            return self.runner.run(knobs, out_dir, rate=rate, seed=seed, duration=duration)
        self.windows -= 1
        hog = start_orphan_hog()
        try:
            return self.runner.run(knobs, out_dir, rate=rate, seed=seed, duration=duration)
        finally:
            stop(hog)


def test_a_competing_process_during_one_window_voids_it_and_the_measurement_runs_it_again(tmp_path: Path) -> None:
    server = SubprocessServer(args=["--admin-token", "secret"])
    try:
        handle = EngineHandle(server.url, "secret")
        assert serving_pid(server.url) == server.process.pid  # the engine, found by its port, is tune's own
        runner = TrialRunner(handle, workload=WorkloadSpec("mixed", 0.125, output_scale=0.25), rate=1.0,
                             duration=2.0, warmup=0.5, slo=SLO(tbt_p99=0.2, ttft_p99=5.0))
        knobs = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "chunk_size": 32}
        spec = MeasurementSpec(max_segments=1)
        quiet = measure(runner, knobs, 1.0, tmp_path / "quiet", 0, spec)
        assert quiet.void is None and len(quiet.segments) == 1
        assert quiet.other_cpu is not None and quiet.other_cpu < BUSY_CORES
        # the other tenant during the first window only: that window is void, the same window again decides
        once = measure(HogDuring(runner, 1), knobs, 1.0, tmp_path / "once", 0, spec)
        assert once.segments[0].reason is not None and once.segments[0].reason.startswith("the machine was busy")
        assert len(once.segments) == 2 and once.void is None and once.verdict == quiet.verdict
        assert once.segments[1].summary["host"]["other_cores"] < BUSY_CORES  # the window again, on a quiet machine
        # (busy during every try: void and "undecided", never the config's miss: tests/test_measurement.py)
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _no_stray_hogs() -> Any:
    yield
    for p in psutil.process_iter(["cmdline"]):
        if p.info["cmdline"] and "while True: pass" in " ".join(p.info["cmdline"]):
            stop(p.pid)
