"""The controller's edges, each against a real HTTP peer: an engine holding another lease (a real engine), an
engine that does not answer (a port nobody listens on) while a restarted controller closes an open canary or while a
canary's verdict is enacted. Each of these once left the controller looping, re-firing, or open to a later keep."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from control_helpers import AUTH, TOKEN, admin_config, records, write_policy
from server_helpers import SubprocessServer, free_port

from policies import load_policy
from slotune.slo import SLO
from policies.control import Canary
from tuner.control.canary import CanaryVerdict, plan_switchback
from tuner.control.canary_run import CanaryRun
from tuner.control.decision_log import DecisionLog
from tuner.control.engine_admin import LeasingEngine
from tuner.control.loop import Controller
from tuner.control.sources import EngineMetricsSource, Scrape
from tuner.measure.statistics import Interval


@pytest.fixture(scope="module")
def engine() -> Iterator[SubprocessServer]:
    server = SubprocessServer(args=["--admin-token", TOKEN, "--max-num-seqs", "8"])
    yield server
    server.stop()


def dead_engine() -> LeasingEngine:
    return LeasingEngine(f"http://127.0.0.1:{free_port()}", TOKEN, timeout=2.0)


def test_another_lease_is_one_logged_decision_and_the_cooldown_holds_the_trigger(engine: SubprocessServer,
                                                                                  tmp_path: Path) -> None:
    """Another client's lease: the controller records one no_move (it used to return without a record, and its
    schedule trigger fired again at every poll)."""
    r = httpx.patch(engine.url + "/admin/config", headers=AUTH, json={"max_num_seqs": 4, "lease_s": 60}, timeout=30)
    assert r.status_code == 200, r.text
    try:
        policy = load_policy(str(write_policy(tmp_path / "policy.yaml", triggers={"schedule": "1s", "window": "1s"},
                                              guardrails={"cooldown": "1m"})))
        log = DecisionLog(tmp_path / "controller.jsonl")
        controller = Controller(policy, EngineMetricsSource(engine.url), LeasingEngine(engine.url, TOKEN), log,
                                poll_s=0.2, say=lambda s: None)
        for _ in range(8):
            controller.tick()
            time.sleep(0.25)
        decisions = [d for d in records(tmp_path / "controller.jsonl") if d["kind"] == "decision"]
        assert len(decisions) == 1 and decisions[0]["outcome"] == "no_move", decisions
        assert "another lease" in decisions[0]["reason"]
        assert admin_config(engine.url)["config"]["max_num_seqs"] == 4  # the other lease is left alone
    finally:
        httpx.patch(engine.url + "/admin/config", headers=AUTH, json={"max_num_seqs": 8}, timeout=30)


def test_a_restart_closes_an_open_canary_once_the_lease_has_run_out_though_the_engine_is_down(tmp_path: Path) -> None:
    log = DecisionLog(tmp_path / "controller.jsonl")
    engine = dead_engine()
    log.write("canary", id=3, kept_knobs={"max_num_seqs": 8}, candidate={"max_num_seqs": 4}, lease_s=2.0,
              lease_until=time.time() + 2.0, trigger={"kind": "drift", "reason": "r"},
              replicas={"0": {"url": engine.url, "arm": "candidate", "generation": 7}})
    controller = Controller(load_policy(), EngineMetricsSource("http://127.0.0.1:9"), engine, log,
                            poll_s=0.2, say=lambda s: None)
    started = time.monotonic()
    controller.close_open_canary()  # it used to retry for as long as the engine was down
    assert time.monotonic() - started < 10
    decisions = [d for d in records(tmp_path / "controller.jsonl") if d["kind"] == "decision"]
    assert [(d["id"], d["outcome"]) for d in decisions] == [(3, "abandoned")]
    assert "did not answer" in decisions[0]["reason"] and "lease had run out" in decisions[0]["reason"]


def scrape_at(t: float, generation: int) -> Scrape:
    return Scrape(t, {("slotune_config_generation", ()): float(generation)})


def test_a_rollback_the_engine_did_not_take_is_never_judged_again_and_kept(tmp_path: Path) -> None:
    spec = Canary(block=4, settle=1, level=0.1, max_window=60, lease_margin=2)
    plan = plan_switchback(spec, 2.0, 0.9, 0.0, seed=1)
    now = time.time()
    engine, log = dead_engine(), DecisionLog(tmp_path / "c.jsonl")
    run = CanaryRun(5, plan, spec, {"max_num_seqs": 8}, {"max_num_seqs": 4}, None, {}, None, [engine], {0: 9},
                    block_started=now, lease_until=now + 1.0)
    run.replicas[0].arm = "candidate"  # the engine runs the candidate, under a lease that ends in a second
    run.final = CanaryVerdict("rollback", "the SLO broke", Interval(-0.5, -0.7, -0.3, 0.9, 20))
    run.final_since = now
    slo = SLO(tbt_p99=0.05)
    assert run.tick(scrape_at(now + 0.1, 9), log, slo) is None  # retried while leased
    assert run.final.action == "rollback"
    ending = run.tick(scrape_at(now + 1.5, 9), log, slo)
    assert ending is not None and ending.outcome == "rolled_back" and "lease ran out" in ending.reason
