"""The controller on a fleet of two real engines under real traffic (one load generator per replica: the split a
round-robin load balancer gives): the canary runs on one replica while the other serves the applied config as its
control over the same seconds, the two trade roles within each pair, and a kept change reaches both; nothing is
lost."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from control_helpers import (
    TOKEN,
    admin_config,
    assert_nothing_lost,
    records,
    start_controller,
    start_traffic,
    stop,
    wait_log,
    write_policy,
)
from server_helpers import SubprocessServer

START = ["--max-num-seqs", "1", "--max-num-batched-tokens", "128", "--chunk-size", "32"]


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[SubprocessServer]]:
    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda _: SubprocessServer(args=["--admin-token", TOKEN, *START],
                                                            env={"OMP_NUM_THREADS": "1"}), range(2)))
    yield servers
    for server in servers:
        server.stop()


@pytest.mark.slow  # about six minutes: two engines, two load generators, a canary of 20 s blocks
def test_a_canary_on_one_replica_against_the_other_is_kept_on_both(fleet: list[SubprocessServer],
                                                                     tmp_path: Path) -> None:
    # measured on a 2-core EPYC serving both engines: at 0.3 req/s per replica one sequence at a time attains
    # 43 % of these requests within a 1 s TTFT (each takes ~3.5 s, so its queue just about keeps up), eight 100 %.
    # Blocks of 20 s, the first 6 s unmeasured, outlast a request; a gain of 40 points needs three or four pairs.
    policy = write_policy(tmp_path / "policy.yaml", slo={"tbt_p99": "1s", "ttft_p99": "1s"},
                          triggers={"window": "20s", "min_requests": 4, "drift_window": "20s"},
                          canary={"block": "20s", "settle": "6s", "level": 0.4, "min_effect": 0.4,
                                  "max_window": "240s", "lease_margin": "10s", "rollback_drop": 0.5})
    loads = [start_traffic(server.url, tmp_path / f"load{i}", "short=16:32", 0.3, "300s", slo=("1s", "1s"),
                           drain="200s") for i, server in enumerate(fleet)]
    log = tmp_path / "controller.jsonl"
    urls = [a for server in fleet for a in ("--engine-url", server.url)]
    controller = start_controller(urls[1], policy, log, *urls[2:], "--propose", '{"max_num_seqs": 8}')
    try:
        canary = wait_log(log, lambda r: r["kind"] == "canary", 90, controller)
        assert canary["plan"]["replicas"] in ([0, 1], [1, 0])
        decision = wait_log(log, lambda r: r["kind"] == "decision" and r["id"] == canary["id"], 300, controller)
        assert decision["outcome"] == "kept", decision["reason"]
        blocks = [r for r in records(log) if r["kind"] == "canary_block" and r["id"] == canary["id"]]
        assert len(blocks) >= 6
        for block in blocks:  # at every moment one replica ran the candidate and the other the applied config
            assert sorted(v["arm"] for v in block["replicas"].values()) == ["applied", "candidate"], block
        assert {b["replicas"]["0"]["arm"] for b in blocks} == {"applied", "candidate"}  # they traded roles
        for server in fleet:
            held = admin_config(server.url)
            assert held["config"]["max_num_seqs"] == 8 and held["lease"] is None
        stop(controller)
        for i, load in enumerate(loads):
            load.wait(300 + 200 + 60)
            assert_nothing_lost(tmp_path / f"load{i}")
    finally:
        stop(controller)
        for load in loads:
            stop(load)
