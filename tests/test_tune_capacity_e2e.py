"""`tune` with the capacity objective on the default model, end to end: an SLO below the machine's floor stops at
once with the measured floor (exit 1, no tuned.yaml); a short study (slow) writes a tuned.yaml with each config's
capacity and its interval, the ratio with its interval, and a last line with the verdict."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.server_helpers import run_tune

POLICY = """
slo: {tbt_p99: 1s, ttft_p99: 5s}
search_space:
  max_num_seqs: {choices: [1, 2, 4]}
  max_num_batched_tokens: {choices: [32, 64]}
  chunk_size: {choices: [16, 32]}
  block_size: {choices: [16, 32]}
constraints: [chunk_size <= max_num_batched_tokens, max_num_seqs <= max_num_batched_tokens]
objective: capacity
trials: 2
trial_duration: 4s
warmup: 1s
workload: {name: mixed, length_scale: 0.125, output_scale: 0.25}
measurement: {cap: 8s, min_gaps: 100}
capacity: {max_probes: 3, start_rate: 0.5}
verdict: {candidates: 1, max_rounds: 2, budget: 60s}
"""


def tune(args: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return run_tune(args, cwd, timeout)


@pytest.mark.slow  # about 50 s; the same stop on the simulator is in the default suite (test_capacity_run_sim)
def test_an_slo_below_the_floor_stops_before_searching_with_the_measured_floor(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    proc = tune(["--policy", "policy.yaml", "--slo-p99-tbt", "1ms", "--out", "out/tuned.yaml"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert re.search(r"floor: batch-1 p99 TBT \d+(\.\d+)?ms \(\d+(\.\d+)?-[\d.?]+\) client-side",
                     proc.stdout), proc.stdout
    assert re.search(r"error: p99 TBT <= 1ms is below this machine's floor: one request at a time already gets p99 "
                     r"TBT \d", proc.stderr), proc.stderr
    assert "nothing written" in proc.stderr
    assert not (tmp_path / "out" / "tuned.yaml").exists() and not (tmp_path / "out" / "tuned.html").exists()
    assert not list((tmp_path / "out" / "tuned-trials").glob("*/trial-*"))  # no trial was started


@pytest.mark.slow
def test_a_short_capacity_study_writes_capacities_with_intervals_and_a_verdict(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    proc = tune(["--policy", "policy.yaml", "--out", "out/tuned.yaml"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert re.match(r"(tuned serves |no config beats the default beyond the noise)", lines[-1]), lines[-1]
    assert re.search(r"\[1/2\] #0 default config \| capacity [\d.]+ req/s \(bracket ", proc.stdout)
    assert re.search(r"req/s: attainment [\d.]+% \([\d.]+-[\d.]+\) (met|missed|undecided), p99 TBT", proc.stdout)
    assert re.search(r"round 1: default ", proc.stdout)
    doc = yaml.safe_load((tmp_path / "out" / "tuned.yaml").read_text())
    assert doc["objective"] == "capacity" and doc["slo"] == {"tbt_p99": 1.0, "ttft_p99": 5.0}
    for side in ("tuned", "default"):
        cap = doc[side]["capacity_req_per_s"]
        assert {"value", "low", "high", "level", "n"} <= set(cap) and cap["n"] >= 1
        assert doc[side]["rounds"] >= 1 and doc[side]["pools"]
    if not doc["evidence"]["tuned_is_default"]:
        assert {"value", "low", "high"} <= set(doc["tuned"]["ratio_to_default"])
    assert doc["evidence"]["verdict_line"] == lines[-1]
    assert doc["evidence"]["floor"]["tbt_p99_batch1"]["n"] > 0
    assert (tmp_path / "out" / "tuned.html").exists() and (tmp_path / "out" / "tuned.vllm.txt").exists()
