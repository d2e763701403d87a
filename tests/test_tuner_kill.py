"""kill -9 of tune leaves nothing running: the engine it started and the Locust process of the trial in flight both
die with it (their own sessions, so only the kernel's parent-death signal reaches them)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from tests.server_helpers import TUNE

POLICY = """
slo: {tbt_p99: 1s, ttft_p99: null}
search_space:
  max_num_seqs: {choices: [1, 2]}
objective: capacity
trials: 2
trial_duration: 30s
warmup: 1s
workload: {name: mixed, length_scale: 0.125, output_scale: 0.25}
"""


def locust_running(children: list[psutil.Process]) -> bool:
    for c in children:
        try:
            if "locust" in " ".join(c.cmdline()):
                return True
        except psutil.Error:
            pass
    return False


def test_kill_9_of_tune_mid_trial_leaves_no_process_of_it(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    with open(tmp_path / "tune.log", "w") as log:
        tune = subprocess.Popen([*TUNE, "--policy", "policy.yaml", "--out", "out/tuned.yaml"], cwd=tmp_path,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline:  # wait for a trial in flight: a Locust child beside the engine
                if locust_running(psutil.Process(tune.pid).children(recursive=True)):
                    break
                assert tune.poll() is None, "tune ended first: " + (tmp_path / "tune.log").read_text()
                time.sleep(0.5)
            else:
                raise AssertionError("no Locust process appeared")
            time.sleep(2)
            children = psutil.Process(tune.pid).children(recursive=True)
            assert len(children) >= 2  # the engine and Locust at least
            os.kill(tune.pid, signal.SIGKILL)
            tune.wait(10)
            _, alive = psutil.wait_procs(children, timeout=30)
            assert not alive, [(p.pid, p.cmdline()) for p in alive]
        finally:
            if tune.poll() is None:
                tune.kill()
