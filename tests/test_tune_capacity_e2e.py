"""`tune` with the capacity objective on the default model, end to end: an SLO below the machine's floor stops at
once with the measured floor and the capacity at the nearest targets it meets (exit 1, no tuned.yaml); a short study (slow) claims only what its evidence shows."""

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
    # what the machine serves instead: the default config's capacity at the nearest targets it meets
    assert re.search(r"the nearest targets this machine meets \(90% of the requests reached them one request at a "
                     r"time\): p99 TBT <= [\d.]+ms and p99 TTFT <= 5.00s; there the default config serves: ",
                     proc.stderr), proc.stderr


@pytest.mark.slow
def test_a_short_capacity_study_claims_only_what_its_evidence_shows(tmp_path: Path) -> None:
    """On the engine: whatever the verdict decides, the printed claims are the evidence's (a pool shown served has
    its interval above 90 %, one shown missed below; "tuned serves R" only where the default was shown to miss at or
    below R; a multiple only from shown bounds; an undecided pool bounds nothing)."""
    (tmp_path / "policy.yaml").write_text(POLICY)
    proc = tune(["--policy", "policy.yaml", "--seed", "3", "--out", "out/tuned.yaml"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\[1/2\] #0 default config \| searched [\d.]+ req/s \(.*\), shown at 95%: served ", proc.stdout)
    assert re.search(r"req/s: attainment [\d.]+% \([\d.]+-[\d.]+\) (met|missed|undecided), within TBT", proc.stdout)
    doc = yaml.safe_load((tmp_path / "out" / "tuned.yaml").read_text())
    assert doc["objective"] == "capacity" and doc["slo"] == {"tbt_p99": 1.0, "ttft_p99": 5.0}
    assert doc["evidence"]["verdict_line"] == last and doc["evidence"]["floor"]["tbt_p99_batch1"]["n"] > 0
    verdict = doc["evidence"]["verdict"]
    for c in [verdict["default"]] + verdict["candidates"]:
        for pool in c["pools"]:
            att = pool["attainment"]
            assert pool["verdict"] != "met" or att["low"] >= 0.9
            assert pool["verdict"] != "missed" or att["high"] < 0.9 or any(s["failed"] for s in pool["samples"])
        low, high = c["shown"]["bracket"]
        decided = {p["rate"]: p["verdict"] for p in c["pools"]}
        assert low == max([r for r, v in decided.items() if v == "met"] or [0.0]) or c["shown"]["contradictions"]
        assert high is None or decided.get(high) == "missed"
    d_high = verdict["default"]["shown"]["bracket"][1]
    if last.startswith("tuned serves"):
        cand = next(c for c in verdict["candidates"] if c["outcome"] == "better")
        served = cand["shown"]["bracket"][0]
        assert served > 0 and d_high is not None and d_high <= served * (1 + 1e-9) and doc["evidence"]["held"]
        assert cand["ratio_to_default"]["low"] == pytest.approx(served / d_high)
    else:
        assert last.startswith("no config was shown to serve more than the default") and not doc["evidence"]["held"]
    assert (tmp_path / "out" / "tuned.html").exists() and (tmp_path / "out" / "tuned.vllm.txt").exists()
