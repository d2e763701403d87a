"""The compose topology started natively: two `slotune serve` replicas, a real Prometheus (Debian's package) with the
shipped config and rules, real open-loop load on both replicas. What Prometheus records agrees with what the load
generator measured on the client; every PromQL expression of the Grafana dashboards returns series; two `tune`
processes share one PostgreSQL study over the two replicas without a duplicate or lost trial."""

from __future__ import annotations

import math
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from engine.metrics import LATENCY_BUCKETS
from loadtest.records import read_records
from loadtest.summary import percentile, request_tbt_p99, token_gaps
from loadtest.config import Option
from tests.deploy_helpers import ComposeLocust, NativeStack, dashboard_queries, run_loadtest
from tests.postgres_helpers import start_postgres
from tests.server_helpers import TUNE
from tuner.search.study import ROLE_DEFAULT, open_storage

SLO_TBT = "0.05"  # the shipped rules' target
LOAD = {"workload": "mixed", "length-scale": "0.125", "rate": "1.5", "duration": "30s", "slo-p99-tbt": "50ms"}


@pytest.fixture(scope="module")
def stack() -> Iterator[NativeStack]:
    s = NativeStack(replicas=2)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def load(stack: NativeStack, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Real load on both replicas, one open-loop schedule each: replica 0 from the compose file's Locust master and
    two workers splitting one schedule, replica 1 from `slotune loadtest`. Before it, a live knob change on replica
    0 and one rejected request per replica (the errors panel's data); after it, waits until Prometheus has evaluated
    its rules on a scrape taken after the load."""
    start = time.time()
    assert stack.prometheus is not None
    # the knob change after Prometheus has seen the old generation, so that its annotation query can see it change
    stack.prometheus.wait_for_series("slotune_config_generation", len(stack.engines))
    for engine in stack.engines:
        assert httpx.post(engine.url + "/v1/completions", json={"prompt": ""}, timeout=30).status_code == 400
    patched = httpx.patch(stack.engines[0].url + "/admin/config", json={"prefill_token_ratio": 0.99},
                          headers={"authorization": f"Bearer {stack.admin_token}"}, timeout=30)
    assert patched.status_code == 200, patched.text
    out = tmp_path_factory.mktemp("load")
    locust = ComposeLocust(stack.engines[0].url, out / "compose-locust", workers=2,
                           options={Option(flag, "", "").env: v for flag, v in LOAD.items()})
    try:
        dirs = [run_loadtest(stack.engines[1].url, out / "loadtest",
                             *[a for flag, v in LOAD.items() for a in (f"--{flag}", v)], seed=1),
                locust.wait(timeout=300)]
    finally:
        locust.stop()
    split = read_records(str(dirs[-1] / "records.parquet"))
    assert {r.worker for r in split} == {0, 1}  # the two workers shared the schedule
    end = time.time()
    stack.prometheus.wait_for_rules_after(end + 5.0, "job:slotune_inter_token_latency_seconds:p99_rate5m")
    records = [r for d in dirs for r in read_records(str(d / "records.parquet"))]
    return {"start": start, "end": end, "records": records}


def scalar(stack: NativeStack, promql: str, at: float | None = None) -> float:
    assert stack.prometheus is not None
    result = stack.prometheus.query(promql, at)
    assert len(result) == 1, (promql, result)
    return float(result[0]["value"][1])


def test_recorded_inter_token_latencies_agree_with_the_client_within_one_bucket(stack: NativeStack,
                                                                                 load: dict) -> None:
    """At every bucket bound, the share of gaps above it in the engines' histogram as Prometheus recorded it lies
    between the client's shares above the bounds next to it (the engine times a gap when its step ends, the client
    when the token arrives, so a gap near a bound may fall on either side). The recorded p99 is shown, not compared
    as a number: with ~600 gaps the 99th percentile is the sixth largest, and where the distribution has a hole
    there (1.06 % of the gaps above 60 ms on both sides in one run, about 1 % above 100 ms) one gap moves it across
    buckets, and histogram_quantile's interpolation inside a sparse bucket with it (65 ms on the client and 104 ms
    recorded, from the same shares)."""
    records = load["records"]
    assert records and all(r.status == "ok" for r in records), {r.status for r in records}
    gaps = np.concatenate([token_gaps(r) for r in records])
    recorded_p99 = scalar(stack, "job:slotune_inter_token_latency_seconds:p99_rate5m")
    assert math.isfinite(recorded_p99)
    print(f"p99 ITL: client {1000 * (percentile(gaps, 99) or 0):.1f} ms, Prometheus {recorded_p99 * 1000:.1f} ms over {len(gaps)} gaps")
    shares = gap_shares(stack, gaps)
    above = {le: client for le, client, _ in shares}
    bounds = [le for le, _, _ in shares]
    # the neighbours of the first bound are 0 s below, above which every gap lies (the client sees some gaps shorter
    # than any step, a token that came late followed by one on time), and of the last +Inf above, where none does;
    # 0.02: rate() extrapolates each replica's counters over its own scrape times, weighting them slightly apart
    off = [(le, client, engines) for i, (le, client, engines) in enumerate(shares)
           if not (above[bounds[i + 1]] if i + 1 < len(bounds) else 0.0) - 0.02 <= engines
           <= (above[bounds[i - 1]] if i > 0 else 1.0) + 0.02]
    print("share of gaps above each bound (bound s, client, Prometheus):", shares)
    assert not off, off


def gap_shares(stack: NativeStack, gaps: np.ndarray) -> list[tuple[float, float, float]]:
    """Per finite bucket bound of the engines' inter-token latency histogram: (bound, the client's share of its gaps
    above it, the engines' share of the last 5 minutes' gaps above it, as Prometheus recorded them)."""
    assert stack.prometheus is not None
    counts = {float(r["metric"]["le"]): float(r["value"][1]) for r in stack.prometheus.query(
        "sum by (le) (increase(slotune_inter_token_latency_seconds_bucket[5m]))")}
    total = counts.get(math.inf) or 1.0
    return [(le, round(float(np.mean(gaps > le)), 4), round(1 - counts[le] / total, 4))
            for le in sorted(counts) if le < math.inf]


def test_recorded_attainment_agrees_with_the_load_test(stack: NativeStack, load: dict) -> None:
    """At the SLO's target and at every bucket boundary where the client's attainment is between 5 % and 95 %, the
    attainment rule lies within one bucket of the load test's: between the shares of requests whose own p99 gap (as
    the client measured it) was within the boundary below and the boundary above. (The engine times a gap when its
    step ends, the client when the token arrives, so a request near a boundary may fall on either side of it.)"""
    records = load["records"]
    own_p99 = np.array([request_tbt_p99(r) for r in records])
    assert stack.prometheus is not None
    # both rules at one instant: the group evaluates them together, but a read of each at its own time may fall
    # on either side of an evaluation
    at = time.time()
    by_le = {float(r["metric"]["le"]): float(r["value"][1])
             for r in stack.prometheus.query("job_le:slotune_tbt_attainment:ratio_rate5m", at)}
    assert scalar(stack, "job:slotune_slo_attainment:ratio_rate5m", at) == pytest.approx(by_le[float(SLO_TBT)])
    bounds = [0.0, *LATENCY_BUCKETS, math.inf]
    client = {b: float(np.mean(own_p99 <= b)) for b in bounds}
    checked, off_by_more = [], []
    for i, target in enumerate(bounds[1:-1], start=1):
        if target != float(SLO_TBT) and not 0.05 <= client[target] <= 0.95:
            continue
        recorded = by_le[target]
        # 0.02: rate() extrapolates each replica's counters over its own scrape times, weighting them slightly apart
        low, high = client[bounds[i - 1]] - 0.02, client[bounds[i + 1]] + 0.02
        checked.append((target, round(client[target], 3), round(recorded, 3)))
        if not low <= recorded <= high:
            off_by_more.append((target, client[bounds[i - 1]], client[target], client[bounds[i + 1]], recorded))
    print("attainment (target s, client, Prometheus):", checked)
    assert not off_by_more, off_by_more
    assert len(checked) >= 2  # the SLO's target and at least one boundary inside the distribution


def test_every_dashboard_query_returns_series(stack: NativeStack, load: dict) -> None:
    assert stack.prometheus is not None
    empty = []
    for q in dashboard_queries():
        if "slotune_controller_" in q.promql:
            continue  # test_dashboard_controller_queries
        result = stack.prometheus.query_range(q.promql, load["start"], time.time(), step=5.0)
        finite = [float(v) for series in result for _, v in series["values"] if math.isfinite(float(v))]
        if not finite:
            empty.append(f"{q.dashboard} / {q.where}: {q.promql}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
    # the $instance variable's query lists both replicas
    instances = {r["metric"]["instance"] for r in stack.prometheus.query('up{job="slotune-engine"}')}
    assert instances == {e.url.removeprefix("http://") for e in stack.engines}


def test_dashboard_controller_queries(stack: NativeStack, load: dict) -> None:
    """The controller (started by NativeStack where it exists) is scraped, and exports every controller metric the
    dashboards query."""
    assert stack.prometheus is not None and stack.controller is not None
    assert stack.controller.poll() is None, "the controller exited"
    stack.prometheus.wait_for_series('up{job="slotune-controller"} == 1', 1)
    queried = {m for q in dashboard_queries() for m in re.findall(r"slotune_controller_\w+", q.promql)}
    exported = {r["metric"]["__name__"] for r in stack.prometheus.query('{__name__=~"slotune_controller_.*"}')}
    assert queried <= exported, f"queried by the dashboards but not exported: {sorted(queried - exported)}"


POLICY = """
slo: {tbt_p99: 1s, ttft_p99: null}
objective: goodput
search_space:
  max_num_seqs: {choices: [1, 2, 4, 8]}
  max_num_batched_tokens: {choices: [32, 64, 128]}
  chunk_size: {choices: [16, 32]}
constraints: [chunk_size <= max_num_batched_tokens, max_num_seqs <= max_num_batched_tokens]
trials: 4
trial_duration: 2s
warmup: 1s
workload: {name: mixed, length_scale: 0.125, output_scale: null}
rate: 1.0
measurement: {busy: null}  # both tune processes share this one machine: each other's engine and load are recorded
"""


def test_two_tune_processes_share_one_postgresql_study(stack: NativeStack, load: dict, tmp_path: Path) -> None:
    """One `tune` per replica (as the compose `tune` job runs), 4 trials between them on one PostgreSQL study."""
    url, stop_postgres = start_postgres()
    (tmp_path / "policy.yaml").write_text(POLICY)
    procs = []
    try:
        for i, engine in enumerate(stack.engines):
            procs.append(subprocess.Popen(
                [*TUNE, "--policy", "policy.yaml", "--storage", url, "--study-name",
                 "replicas", "--engine-url", engine.url, "--admin-token", stack.admin_token,
                 "--out", f"out{i}/tuned.yaml"],
                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            time.sleep(3)  # the second joins the study the first created
        outs = [p.communicate(timeout=420)[0] for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out[-3000:]
        trials = optuna.load_study(study_name="replicas", storage=open_storage(url)).get_trials()
        assert [t.state for t in trials] == [TrialState.COMPLETE] * 4  # none lost, none extra
        assert sum(t.user_attrs.get("role") == ROLE_DEFAULT for t in trials) == 1
        ran = [{int(n) for n in re.findall(r"^\[\d+/4\] #(\d+) ", out, re.M)} for out in outs]
        assert ran[0] and ran[1], outs  # both replicas were tuned
        assert not ran[0] & ran[1] and ran[0] | ran[1] == {t.number for t in trials}  # no trial run twice
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        stop_postgres()
