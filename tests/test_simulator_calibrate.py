"""`slotune calibrate`: the pieces it derives from the engine's answers, its refusals, and (slow) a real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.commands.calibrate import busy_gaps
from engine.cpu_info import cpu_name
from tuner.simulation.profiles import DEFAULT_PROFILE, SHIPPED_PROFILES, limits_from, limits_of, profile_path
from tuner.simulation.step_time_model import StepTimeModel

REPO = Path(__file__).resolve().parent.parent


def step(n: int, start: float, total: float, running: int) -> dict:
    return {"step": n, "start_time": start, "total_s": total, "num_running": running, "num_waiting": 0,
            "num_preempted": 0}


def test_busy_gaps_count_only_steps_that_follow_at_once() -> None:
    steps = [step(0, 0.0, 0.1, 2), step(1, 0.102, 0.1, 0),  # busy: 2 ms between them
             step(2, 5.0, 0.1, 1),  # the engine was idle before this one: not a gap
             step(3, 5.104, 0.1, 1), step(5, 9.0, 0.1, 1)]  # 4 ms; then a step missing from the buffer
    assert busy_gaps(steps) == pytest.approx([0.002, 0.004])


def test_model_limits_are_recovered_from_the_admin_config() -> None:
    # SmolLM2-135M in float32: 46080 bytes per token; 1 GiB pool; the server resolves the block count.
    for block_size in (8, 16, 32):
        n = (1 << 30) // (46080 * block_size)
        got = limits_from({"config": {"kv_cache_bytes": 1 << 30, "block_size": block_size, "num_kv_blocks": None,
                                      "max_model_len": None},
                           "resolved": {"num_kv_blocks": n, "max_model_len": 8192}})
        assert got == {"max_context_len": 8192, "kv_bytes_per_token": 46080}


def test_the_simulator_takes_a_live_engines_limits_over_its_profiles() -> None:
    profile = StepTimeModel.load(profile_path(None, "float32"))
    n = (1 << 30) // (23040 * 16)  # a bf16 engine's pool: half the KV bytes per token, twice the blocks
    admin = {"config": {"kv_cache_bytes": 1 << 30, "block_size": 16, "num_kv_blocks": None, "max_model_len": None},
             "resolved": {"num_kv_blocks": n, "max_model_len": 8192}}
    assert limits_of(profile).kv_bytes_per_token == 46080
    assert limits_of(profile, admin).kv_bytes_per_token == 23040


def test_each_dtype_of_the_default_engine_has_its_shipped_profile_per_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLOTUNE_PROFILE", raising=False)
    for dtype, by_cpu in SHIPPED_PROFILES.items():
        for cpu, path in by_cpu.items():
            assert profile_path(None, dtype, cpu) == path
            model = StepTimeModel.load(path)
            assert limits_of(model).kv_bytes_per_token == {"float32": 46080, "bfloat16": 23040}[dtype]
            assert model.meta["health"].get("dtype", "float32") == dtype
            assert model.meta.get("cpu", cpu) == cpu  # a profile that records its CPU is filed under it
        # a CPU no profile was calibrated on takes the dtype's first, which tune then rescales
        assert profile_path(None, dtype, "Some Other CPU") == next(iter(by_cpu.values()))
    assert profile_path(None, None, "AMD EPYC") == profile_path(None, "float16", "AMD EPYC") == DEFAULT_PROFILE
    assert profile_path("mine.json", "bfloat16") == Path("mine.json")


def test_calibrate_refuses_an_engine_url_without_a_token(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "slotune.cli", "calibrate", "--engine-url", "http://127.0.0.1:9",
                        "--out", str(tmp_path / "p.json")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--admin-token" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_calibrate_profiles_the_real_engine(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    p = subprocess.run([sys.executable, "-m", "slotune.cli", "calibrate", "--seconds-per-config", "6",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    model = StepTimeModel.load(out)
    assert model.fit_error is not None and model.fit_error.n > 5
    assert model.ranges["block_size"] == [8.0, 32.0] and model.ranges["num_seqs"][1] > 1
    assert model.noise and model.gap_s >= 0 and model.token_latency_s > 0
    # the engine's default dtype (auto): 46080 KV bytes per token in float32, half in bfloat16
    kv_bytes = 46080 if model.meta["health"]["dtype"] == "float32" else 23040
    assert model.meta["limits"] == {"max_context_len": 8192, "kv_bytes_per_token": kv_bytes}
    assert model.meta["cpu"] == cpu_name()  # it started the engine here: the profile is filed under this CPU
    steps = [json.loads(line) for line in out.with_suffix(".steps.jsonl").read_text().splitlines()]
    assert len(steps) == model.meta["steps"] and {s["block_size"] for s in steps} == {8, 16, 32}
    # A batch-1 decode step is predicted within a factor of two of what the engine measured for one.
    decodes = sorted(s["total_s"] for s in steps if s["num_prefill_seqs"] == 0 and s["num_decode_tokens"] == 1)
    if decodes:
        median = decodes[len(decodes) // 2]
        assert 0.5 < model.predict(0, 0, 1, 100, 16) / median < 2.0
