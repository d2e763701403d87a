"""End to end on the default engine with real Locust traffic that shifts: the engine starts on a config that suits
phase one (few sequences at a low rate, short outputs); phase two sends 160-token outputs at about twice the rate,
the queue and the TTFT grow, attainment falls; the controller detects it, screens candidates in the simulator, canaries one under a lease, keeps it, and
attainment of the requests sent from 120 s after the shift on is at least 90 %. No request fails or is lost across
the changes. About 4-6 minutes on 2 cores, so marked slow; the benchmark benchmarks/controller_shift.py runs the
long version against static configs."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
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
    write_policy,
)
from server_helpers import SubprocessServer

from loadtest.records import read_records
from slotune.slo import SLO
from loadtest.summary import attains
from tuner.measure.statistics import proportion_interval

PHASE_ONE = ["--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--chunk-size", "32", "--block-size", "16"]
RECOVERY_S = 120.0  # the stated time: requests sent this long after the shift attain >= 90 %
SLO_ARGS = ("500ms", "3s")
# Phase one's and phase two's rates: phase two must exceed what two sequences serve on this machine. Four times the
# rate of short outputs did not on a quiet 2-core AMD EPYC (two sequences served it and the controller rightly kept
# them); long outputs at 0.9 req/s broke them there and on a 2-core Intel Xeon (a faster machine needs a higher
# rate, e.g. SLOTUNE_SHIFT_RATES=0.4,1.5).
RATES = tuple(float(x) for x in os.environ.get("SLOTUNE_SHIFT_RATES", "0.4,0.9").split(","))
PHASE_TWO_MIX = "long=16:160"


@pytest.fixture(scope="module")
def engine() -> Iterator[SubprocessServer]:
    server = SubprocessServer(args=["--admin-token", TOKEN, *PHASE_ONE])
    yield server
    server.stop()


@pytest.mark.slow
def test_the_controller_detects_a_shift_moves_the_knobs_and_attainment_recovers(engine: SubprocessServer,
                                                                               tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policy.yaml", slo={"tbt_p99": SLO_ARGS[0], "ttft_p99": SLO_ARGS[1]},
                          guardrails={"default_max_change": 4, "cooldown": "5s"},
                          triggers={"window": "15s", "min_requests": 10, "drift_window": "15s"},
                          canary={"block": "10s", "settle": "4s", "level": 0.1, "max_window": "120s",
                                  "lease_margin": "10s", "rollback_drop": 0.15},
                          retune={"candidates": 16, "sim_duration": "15s", "step_history": "60s"})
    log = tmp_path / "controller.jsonl"
    controller = start_controller(engine.url, policy, log)
    phase1 = phase2 = None
    try:
        phase1 = start_traffic(engine.url, tmp_path / "phase1", "short=16:24", RATES[0], "45s", SLO_ARGS)
        phase1.wait(300)
        shift = time.time()
        phase2 = start_traffic(engine.url, tmp_path / "phase2", PHASE_TWO_MIX, RATES[1], "300s", SLO_ARGS)
        phase2.wait(600)
    finally:
        stop(controller)
        for p in (phase1, phase2):
            if p is not None:
                stop(p)
    decisions = [r for r in records(log) if r["kind"] == "decision"]
    kept = [d for d in decisions if d["outcome"] == "kept" and d["time"] > shift]
    assert kept, [(d["outcome"], d["reason"]) for d in decisions]
    assert admin_config(engine.url)["config"]["max_num_seqs"] > 2
    for phase in ("phase1", "phase2"):
        assert_nothing_lost(tmp_path / phase)
    slo = SLO(tbt_p99=0.5, ttft_p99=3.0)
    reqs = read_records(str(tmp_path / "phase2" / "records.parquet"))
    t0 = min(r.intended_send_time for r in reqs)
    late = [r for r in reqs if r.intended_send_time - t0 >= RECOVERY_S]
    attained = proportion_interval(sum(attains(r, slo) for r in late), len(late))
    print(f"kept at +{kept[0]['time'] - shift:.0f}s: {kept[0]['candidate']}; attainment from +{RECOVERY_S:g}s: "
          f"{attained.format(scale=100)} % of {len(late)}")
    assert attained.value >= 0.9, attained
