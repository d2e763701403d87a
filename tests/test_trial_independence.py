"""Consecutive trials are independent: each starts with the prefix cache emptied, so replaying the same prompts (the
same arrival draw) in a second trial does not let it ride on the first one's cached blocks. And a trial runner takes
its SLO as the one record every judge reads, never as a loose dict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policies import WorkloadSpec
from slotune.slo import SLO
from tests.server_helpers import SubprocessServer
from tuner.trials.engine_handle import EngineHandle
from tuner.trials.trial_runner import TrialRunner


def hit_tokens(folder: Path) -> int:
    lines = (folder / "steps.jsonl").read_text().splitlines()
    return sum(json.loads(line).get("prefix_cache_hit_tokens", 0) for line in lines if line)


def test_a_repeated_trial_does_not_ride_on_the_previous_trials_prefix_cache(tmp_path: Path) -> None:
    server = SubprocessServer(args=["--admin-token", "secret"])
    try:
        handle = EngineHandle(server.url, "secret")
        runner = TrialRunner(handle, workload=WorkloadSpec("mixed", 0.125, output_scale=0.25), rate=2.0,
                             duration=4.0, warmup=1.0, slo=SLO(tbt_p99=1.0))
        knobs = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "chunk_size": 32}
        first = runner.run(knobs, tmp_path / "first", seed=5)
        assert first.summary["completed"] > 0
        second = runner.run(knobs, tmp_path / "second", seed=5)  # the same prompts, in the same order
        assert second.summary["completed"] == first.summary["completed"]
        # the second trial finds in the cache what the first one did (its own repeats only), not the first's blocks
        assert hit_tokens(tmp_path / "second") == hit_tokens(tmp_path / "first")
        assert handle.reset_prefix_cache() > 0  # the second trial's blocks were cached: there was something to reuse
        assert handle.reset_prefix_cache() == 0
    finally:
        server.stop()


def test_a_trial_runner_refuses_an_slo_that_is_not_the_slo_record() -> None:
    # nothing reaches the engine: the runner is refused before it asks the engine for its config
    with pytest.raises(TypeError, match="slo must be a slotune.slo.SLO record, got dict"):
        TrialRunner(EngineHandle("http://127.0.0.1:9"), slo={"tbt_p99": 0.05})  # type: ignore[arg-type]
