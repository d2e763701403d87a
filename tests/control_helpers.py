"""Running the real controller (`slotune control` subprocess) against a real engine with real Locust traffic
(`slotune loadtest` subprocesses), and reading its decision log."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.server_helpers import REPO

TOKEN = "control-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}

BASE_POLICY: dict[str, Any] = {
    "slo": {"tbt_p99": "1s", "ttft_p99": "2s"},
    "search_space": {"max_num_seqs": {"low": 1, "high": 16, "log": True},
                     "max_num_batched_tokens": {"choices": [16, 32, 64, 128, 256]},
                     "chunk_size": {"choices": [8, 16, 32, 64, 128]},
                     "block_size": {"choices": [8, 16, 32]}},
    "constraints": ["chunk_size <= max_num_batched_tokens", "max_num_seqs <= max_num_batched_tokens"],
    "guardrails": {"default_max_change": 8, "cooldown": "3s", "frozen": []},
    "triggers": {"attainment_target": 0.9, "window": "10s", "min_requests": 8, "drift_window": "10s"},
    # 4 s blocks, 3 s of each measured; level 0.1: at least five pairs (40 s), at most seven
    "canary": {"block": "4s", "settle": "1s", "level": 0.1, "max_window": "60s", "lease_margin": "5s",
               "rollback_drop": 0.15},
    "retune": {"candidates": 12, "sim_duration": "10s", "step_history": "60s"},
}


def write_policy(path: Path, **sections: Any) -> Path:
    policy = {**BASE_POLICY, **sections}
    path.write_text(yaml.safe_dump(policy))
    return path


def start_controller(engine_url: str, policy: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    with open(log.with_suffix(".err"), "ab") as err:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-m", "slotune.cli", "control", "--engine-url", engine_url,
                                 "--admin-token", TOKEN, "--policy", str(policy), "--log", str(log), "--poll", "1",
                                 *args], cwd=REPO, stdout=err, stderr=subprocess.STDOUT)


def start_traffic(engine_url: str, out: Path, mix: str, rate: float, duration: str,
                  slo: tuple[str, str] = ("1s", "2s"), drain: str = "60s") -> subprocess.Popen[bytes]:
    with open(out.with_suffix(".log"), "wb") as err:
        return subprocess.Popen([sys.executable, "-m", "slotune.cli", "loadtest", "--url", engine_url, "--workload",
                                 "mixed", "--mix", mix, "--mix-weights", "1", "--rate", str(rate), "--duration",
                                 duration, "--out", str(out), "--slo-p99-tbt", slo[0], "--slo-p99-ttft", slo[1],
                                 "--drain-timeout", drain], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)


def records(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def wait_log(log: Path, predicate: Callable[[dict[str, Any]], bool], timeout: float,
             process: subprocess.Popen[bytes] | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in records(log) if predicate(r)]
        if found:
            return found[0]
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the controller exited ({process.returncode}): "
                                 f"{log.with_suffix('.err').read_text()[-2000:]}")
        assert time.monotonic() < deadline, f"timed out; log so far: {records(log)[-5:]}; stderr: " \
                                            f"{log.with_suffix('.err').read_text()[-2000:]}"
        time.sleep(0.5)


def admin_config(engine_url: str) -> dict[str, Any]:
    r = httpx.get(engine_url + "/admin/config", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def assert_nothing_lost(out: Path) -> dict[str, Any]:
    s = summary(out)
    assert s["requests"] > 0 and s["failed"] == 0 and s["unfinished"] == 0 and s["lost_requests"] == 0, \
        {k: s.get(k) for k in ("requests", "completed", "failed", "unfinished", "lost_requests")}
    return s


def stop(process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

