"""Consecutive trials are independent: each starts with the prefix cache emptied, so replaying the same prompts (the
same arrival draw) in a second trial does not let it ride on the first one's cached blocks."""

from __future__ import annotations

import json
from pathlib import Path

from policies import WorkloadSpec
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
                             duration=4.0, warmup=1.0, slo={"tbt_p99": 1.0})
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
