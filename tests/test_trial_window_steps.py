"""A trial's step records are the steps that made its measurement window's tokens. The window counts the requests
sent in it, to their last token; most of those tokens come after the window closes (a request sent near its end is
served in the drain). Cutting the step records at the window's end left a short window with few or none (the first
trial after a config change, whose steps the screen is rescaled to, came back empty on a busy machine).

A trace puts the window's only request 10 ms before the window closes: on any machine nearly all its steps start
after the window's end, so the test does not depend on the engine's speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slotune.slo import SLO
from policies import WorkloadSpec
from tuner.simulation.simulator_trial import SimTrialRunner
from tuner.simulation.step_time_model import StepTimeModel

OUTPUT_TOKENS = 48
WARMUP_S, DURATION_S = 1.0, 1.0
# trace rows at 0 s (a warm-up request) and 1 s; the rate stretches them to 0 s and 1.99 s (the window is [1, 2) s)
RATE = 1 / 1.99


def trace(folder: Path) -> Path:
    path = folder / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 16, "output_length": 4, "hash_ids": []},
            {"timestamp": 1000, "input_length": 32, "output_length": OUTPUT_TOKENS, "hash_ids": []}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def window_steps(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "steps.jsonl").read_text().splitlines() if line.strip()]


def test_a_trials_steps_are_those_that_served_its_windows_requests_on_the_engine(tmp_path: Path) -> None:
    from tests.server_helpers import SubprocessServer
    from tuner.trials.engine_handle import EngineHandle
    from tuner.trials.trial_runner import TrialRunner

    server = SubprocessServer(args=["--admin-token", "secret", "--block-size", "16"])
    try:
        handle = EngineHandle(server.url, "secret")
        runner = TrialRunner(handle, workload=WorkloadSpec(str(trace(tmp_path))), rate=RATE, duration=DURATION_S,
                             warmup=WARMUP_S, slo=SLO(tbt_p99=5.0))
        # a config change that re-lays the KV cache, as the first trial of a screen after another config
        outcome = runner.run({"block_size": 32}, tmp_path / "trial")
        assert outcome.summary["requests"] == 1 and outcome.summary["completed"] == 1, outcome.summary
        steps = window_steps(tmp_path / "trial")
        # every token of the window's request came from a step of the trial's records: the prefill step makes the
        # first token, each decode step one more
        made = [s for s in steps if s["num_decode_tokens"] or s["num_prefill_tokens"]]
        assert len(made) >= OUTPUT_TOKENS, f"{len(steps)} step records for a request of {OUTPUT_TOKENS} tokens"
        assert outcome.step_stats["steps"] == len(steps)
        assert {s["config_generation"] for s in steps} == {handle.health()["config_generation"]}
    finally:
        server.stop()


@pytest.fixture()
def model() -> StepTimeModel:
    coef = {"const": 0.030, "tokens": 4e-4, "seqs": 1e-3, "prefill_seqs": 1e-3, "context_tokens": 1e-6,
            "context_blocks": 1e-5, "prefill_square": 0.0, "swapped_blocks": 1e-4}
    ranges = {"num_prefill_seqs": [0, 16], "num_prefill_tokens": [0, 512], "num_decode_tokens": [0, 16],
              "context_tokens": [0, 20000], "num_seqs": [1, 16], "num_swapped_blocks": [0, 0], "block_size": [8, 32]}
    return StepTimeModel(coef=coef, ranges=ranges, gap_s=0.002, request_latency_s=0.001, token_latency_s=0.001)


def test_the_simulator_keeps_the_same_steps_as_the_engine(tmp_path: Path, model: StepTimeModel) -> None:
    runner = SimTrialRunner(model, workload=WorkloadSpec(str(trace(tmp_path))), rate=RATE, duration=DURATION_S,
                            warmup=WARMUP_S, slo=SLO(tbt_p99=5.0))
    outcome = runner.run({"block_size": 32}, tmp_path / "sim")
    assert outcome.summary["requests"] == 1 and outcome.summary["completed"] == 1, outcome.summary
    steps = window_steps(tmp_path / "sim")
    assert len(steps) == OUTPUT_TOKENS  # 30 ms a step: all but the first start after the window closed
    assert outcome.step_stats["steps"] == OUTPUT_TOKENS
