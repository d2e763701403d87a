"""The simulator as a user meets it: `slotune simulate` writes a trial folder the tuner and dashboard read, bad
input is refused with the flag named, load shapes move the numbers the right way, and it is fast."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.step_record import StepRecord
from loadtest.config import LoadConfig
from loadtest.records import read_records
from slotune.slo import SLO
from policies import WorkloadSpec
from tuner.simulation.simulator import simulate_load
from tuner.simulation.simulator_trial import SimTrialRunner
from tuner.simulation.step_time_model import StepTimeModel

REPO = Path(__file__).resolve().parent.parent
# A CPU-engine-like model: 30 ms a step, 0.4 ms a token, 1 ms a sequence; profiled up to 16 sequences.
COEF = {"const": 0.030, "tokens": 4e-4, "seqs": 1e-3, "prefill_seqs": 1e-3, "context_tokens": 1e-6,
        "context_blocks": 1e-5, "prefill_square": 0.0, "swapped_blocks": 1e-4}
RANGES = {"num_prefill_seqs": [0, 16], "num_prefill_tokens": [0, 512], "num_decode_tokens": [0, 16],
          "context_tokens": [0, 20000], "num_seqs": [1, 16], "num_swapped_blocks": [0, 0], "block_size": [8, 32]}


@pytest.fixture()
def model() -> StepTimeModel:
    return StepTimeModel(coef=dict(COEF), ranges={k: list(v) for k, v in RANGES.items()}, gap_s=0.002,
                         request_latency_s=0.001, token_latency_s=0.001)


@pytest.fixture()
def profile(tmp_path: Path, model: StepTimeModel) -> Path:
    path = tmp_path / "profile.json"
    model.save(path)
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slotune.cli", "simulate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_simulate_cli_writes_a_trial_folder(tmp_path: Path, profile: Path) -> None:
    out = tmp_path / "trial"
    p = run_cli("--profile", str(profile), "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
                "--chunk-size", "64", "--workload", "mixed", "--length-scale", "0.125", "--rate", "2",
                "--duration", "60s", "--slo-p99-tbt", "80ms", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "TBT p50 / p90 / p99" in p.stdout and "goodput" in p.stdout  # the load test's table
    trial = json.loads((out / "trial.json").read_text())
    assert trial["format"] == "slotune-trial/1" and trial["simulated"] is True
    assert trial["knobs"]["max_num_seqs"] == 8 and trial["knobs"]["chunk_size"] == 64
    assert set(trial) >= {"knobs", "step_stats", "feasible", "reason", "workload", "rate", "slo", "started_at"}
    summary = json.loads((out / "summary.json").read_text())
    records = read_records(str(out / "records.parquet"))
    assert summary["requests"] == len(records) > 80 and summary["completed"] == len(records)
    assert summary["simulated"] is True and summary["slo"]["tbt_p99"] == 0.08
    assert all(r.output_tokens == r.max_tokens and r.ttft > 0 for r in records)
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == trial["step_stats"]["steps"] > 100
    assert set(steps[0]) == set(StepRecord.__dataclass_fields__)
    assert max(s["num_prefill_seqs"] + s["num_decode_tokens"] for s in steps) <= 8
    assert max(s["num_prefill_tokens"] + s["num_decode_tokens"] for s in steps) <= 128


def test_simulate_cli_refuses_bad_input_naming_the_flag(tmp_path: Path, profile: Path) -> None:
    p = run_cli("--profile", str(profile), "--max-num-seqs", "0", "--rate", "1", "--out", str(tmp_path / "a"))
    assert p.returncode == 2 and "max_num_seqs" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("--profile", str(profile), "--rate", "-1", "--out", str(tmp_path / "b"))
    assert p.returncode == 2 and "--rate" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("--profile", str(tmp_path / "nope.json"), "--rate", "1", "--out", str(tmp_path / "c"))
    assert p.returncode == 2 and "--profile" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "a").exists()


def test_overload_and_big_batches_move_the_numbers_the_right_way(model: StepTimeModel) -> None:
    def run(rate: float, max_num_seqs: int) -> dict:
        cfg = LoadConfig(workload="mixed", rate=rate, duration=120, length_scale=0.125, slo=SLO(0.05),
                         drain_timeout=5)
        return simulate_load(cfg, {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 256}, model)[1]

    light, heavy = run(1.0, 8), run(20.0, 8)
    assert light["completed"] == light["requests"] and light["attainment"] > heavy["attainment"]
    assert heavy["ttft_p99"] > 10 * light["ttft_p99"] and heavy["unfinished"] > 0
    # A bigger batch makes each step (so each gap) longer: p99 TBT grows with max_num_seqs under load.
    assert run(6.0, 16)["tbt_p99"] > run(6.0, 2)["tbt_p99"]


def test_a_backlog_at_the_start_holds_the_window_s_requests_behind_it(model: StepTimeModel) -> None:
    # a config that keeps up from an empty engine, started behind a live queue of 40 requests: the window's own
    # requests wait for the queue to drain (first come, first served), so its TTFT and attainment show it
    workload = WorkloadSpec("mixed", 0.125, output_scale=0.25)
    slo = SLO(tbt_p99=0.5, ttft_p99=2.0)
    empty = SimTrialRunner(model, workload=workload, rate=1.0, duration=20, warmup=3, slo=slo)
    behind = SimTrialRunner(model, workload=workload, rate=1.0, duration=20, warmup=3, slo=slo, backlog=40)
    knobs = {"max_num_seqs": 4, "max_num_batched_tokens": 256}
    a, b = empty.run(knobs).summary, behind.run(knobs).summary
    assert a["attainment"] == 1.0 and a["requests"] == b["requests"]  # the backlog is waited behind, not measured
    assert b["ttft_p99"] > 10 * a["ttft_p99"] and b["attainment"] < 0.8


def test_simulated_trial_matches_the_trial_runner_outcome(tmp_path: Path, model: StepTimeModel) -> None:
    runner = SimTrialRunner(model, workload="mixed", rate=2.0, duration=20, warmup=3)
    outcome = runner.run({"max_num_seqs": 4, "max_num_batched_tokens": 64}, tmp_path / "t")
    assert outcome.simulated and outcome.summary["window"] == [3, 23]
    assert outcome.feasible == (outcome.summary["tbt_p99"] <= 0.05)
    rejected = runner.run({"max_num_seqs": 128, "max_num_batched_tokens": 64})
    assert not rejected.feasible and "max_num_seqs" in (rejected.reason or "")


def test_extrapolation_is_reported_not_silent(model: StepTimeModel) -> None:
    cfg = LoadConfig(workload="mixed", rate=40, duration=30, length_scale=0.125)
    with pytest.warns(UserWarning) as caught:
        _, summary = simulate_load(cfg, {"max_num_seqs": 64, "max_num_batched_tokens": 512}, model)
    assert {"num_decode_tokens", "num_seqs"} <= {str(w.message).split()[2] for w in caught}
    assert any("extrapolated" in w for w in summary["warnings"])


def test_an_hour_of_traffic_simulates_in_seconds(model: StepTimeModel) -> None:
    cfg = LoadConfig(workload="mixed", rate=3, duration=3600, length_scale=0.125)
    start = time.perf_counter()
    result, summary = simulate_load(cfg, {"max_num_seqs": 16, "max_num_batched_tokens": 256, "chunk_size": 64},
                                    model)
    elapsed = time.perf_counter() - start
    assert summary["requests"] > 10000 and len(result.steps_raw) > 50000
    assert elapsed < 30, f"an hour of mixed traffic took {elapsed:.1f}s"  # ~3 s on one quiet core
