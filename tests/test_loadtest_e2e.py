"""End to end: `slotune loadtest` (Locust in its own processes) against a real streaming HTTP server on loopback.

The server is tests/streaming_stub_server.py, which stands in for the engine's timing only: a token to every
running request every 20 ms, and a log of when it received each request and wrote each token, so the client's
measurements can be checked against the server's own clock.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from loadtest.config import LoadConfig
from loadtest.records import read_records
from loadtest.runner import run_loadtest

REPO = Path(__file__).resolve().parents[1]
INTERVAL = 0.02
MIX = "short=16:8,medium=64:16,long=256:32"
# The timing tests run the load processes with a real-time priority where allowed (`--realtime`): this small
# machine is shared with other work that can saturate its CPUs, and a generator that doesn't get the CPU when a
# send is due is late however good its event loop is.


@pytest.fixture(scope="module")
def stub():
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "streaming_stub_server.py"), "--port", "0",
                             "--interval", str(INTERVAL)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("LISTENING"), line
    yield f"http://127.0.0.1:{int(line.split()[1])}"
    proc.terminate()
    proc.wait(10)


def stub_stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/stats?tokens=1", timeout=10) as r:
        return json.load(r)["requests"]


def latest(records, summary) -> str:
    """For a failure message: the latest sends, and the priority the load process got."""
    worst = sorted(records, key=lambda r: -r.send_lag)[:5]
    return (f"send lag p99 {summary['send_lag_p99'] * 1e3:.2f} ms ({summary.get('load_process_scheduling')}); "
            "latest (lag ms, scheduled s): " + ", ".join(f"({r.send_lag * 1e3:.1f}, {r.scheduled_at:.2f})" for r in worst))


def check_against_server(records, server: dict) -> None:
    """Every request reached the server exactly once, and the client's token times follow the server's."""
    assert len({r.id for r in records}) == len(records)
    errors, gap_diffs = [], []
    for r in records:
        s = server[r.id]
        assert "duplicates" not in s, f"{r.id} reached the server twice"
        assert r.output_tokens == len(s["tokens"]) == r.max_tokens
        assert s["received"] >= r.actual_send_time - 1e-3  # sent before the server got it (clocks agree to ~us)
        client, srv = np.array(r.token_times), np.array(s["tokens"])
        errors.extend(client - srv)
        gap_diffs.extend(np.diff(client) - np.diff(srv))
    errors, gap_diffs = np.array(errors), np.abs(np.array(gap_diffs))
    # a token is seen after the server wrote it, and soon after
    assert errors.min() > -1e-3, errors.min()
    assert np.percentile(errors, 50) < 2e-3, np.percentile(errors, 50)
    assert np.percentile(gap_diffs, 50) < 1e-3 and np.percentile(gap_diffs, 99) < 8e-3, np.percentile(gap_diffs, 99)


def test_cli_run_20_rps_open_loop(stub, tmp_path):
    out = tmp_path / "run"
    before = set(stub_stats(stub))
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "slotune.cli", "loadtest", "--url", stub, "--workload", "mixed", "--mix", MIX,
         "--rate", "20", "--duration", "10s", "--out", str(out), "--slo-p99-tbt", "50ms", "--slo-p99-ttft", "1s",
         "--seed", "7", "--realtime"], capture_output=True, text=True, timeout=120)
    wall = time.monotonic() - t
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "attainment" in proc.stdout and "send lag" in proc.stdout  # the table
    assert "sent" in proc.stderr  # the progress line
    s = json.loads((out / "summary.json").read_text())
    records = read_records(str(out / "records.parquet"))

    n = s["scheduled_requests"]
    assert 150 < n < 250 and s["requests"] == n == len(records) and s["lost_requests"] == 0
    assert sorted(r.index for r in records) == list(range(n))  # no request lost or sent twice
    assert s["completed"] == n and s["failed"] == s["unfinished"] == s["not_sent"] == 0
    assert s["send_lag_p99"] < 0.010, latest(records, s)  # open loop, on time
    assert s["generator_kept_up"] and s["duplicate_records"] == 0
    for key in ("requests", "completed", "failed", "duration_s", "throughput_rps", "output_tokens_per_s",
                "ttft_p50", "ttft_p90", "ttft_p99", "tbt_p50", "tbt_p90", "tbt_p99", "attainment", "goodput_rps",
                "goodput_tokens_per_s", "send_lag_p99", "workload", "length_scale", "time_scale", "slo"):
        assert key in s, key
    assert s["slo"] == {"tbt_p99": 0.05, "ttft_p99": 1.0, "e2e_p99": None}
    assert s["duration_s"] == 10.0 and s["throughput_rps"] == pytest.approx(n / 10.0)
    # TBT measured = the server's step interval; TTFT within one step of the intended send time
    assert s["tbt_p50"] == pytest.approx(INTERVAL, abs=1e-3)
    assert 0 < s["ttft_p50"] < INTERVAL + 5e-3
    assert s["attainment"] > 0.9
    # intended send times follow the schedule the config gives, and every request went out at its time
    assert [r.scheduled_at for r in sorted(records, key=lambda r: r.index)] == pytest.approx(
        [x.at for x in __import__("loadtest.schedule", fromlist=["x"]).build_schedule(
            LoadConfig(workload="mixed", mix=MIX, rate=20.0, duration=10.0, seed=7)).requests])
    server = {k: v for k, v in stub_stats(stub).items() if k not in before}
    assert len(server) == n
    check_against_server(records, server)
    assert wall < 40


def test_two_workers_keep_one_schedule(stub, tmp_path):
    cfg = LoadConfig(url=stub, workload="mixed", mix=MIX, rate=20.0, duration=6.0, seed=11, out=str(tmp_path / "w2"))
    before = set(stub_stats(stub))
    s = run_loadtest(cfg, workers=2, realtime=True)
    records = read_records(str(tmp_path / "w2" / "records.parquet"))
    n = s["scheduled_requests"]
    assert s["workers"] == 2 and s["requests"] == n == len(records) and s["lost_requests"] == 0
    assert sorted(r.index for r in records) == list(range(n))
    assert {r.worker for r in records} == {0, 1}
    assert all(r.index % 2 == r.worker for r in records)  # the round-robin split
    assert s["completed"] == n and s["duplicate_records"] == 0
    assert s["send_lag_p99"] < 0.010, latest(records, s)
    server = {k: v for k, v in stub_stats(stub).items() if k not in before}
    assert sorted(server) == sorted(r.id for r in records)  # each reached the server once, from one worker
    check_against_server(records, server)


def test_unreachable_server_fails_requests_not_the_run(tmp_path):
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]  # closed again: nothing listens there
    cfg = LoadConfig(url=f"http://127.0.0.1:{port}", rate=10.0, duration=1.0, mix=MIX, out=str(tmp_path / "down"),
                     records_format="csv")
    s = run_loadtest(cfg)
    assert s["requests"] > 0 and s["failed"] == s["requests"] and s["attainment"] == 0.0
    assert any("connection" in w for w in s["warnings"])
    assert (tmp_path / "down" / "records.csv").exists()


def test_silent_server_times_out_and_slow_streams_end_unfinished(stub, tmp_path):
    with socket.socket() as silent:  # accepts connections (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        cfg = LoadConfig(url=f"http://127.0.0.1:{silent.getsockname()[1]}", rate=5.0, duration=1.0, mix=MIX,
                         request_timeout=1.0, drain_timeout=5.0, out=str(tmp_path / "silent"))
        s = run_loadtest(cfg)
    assert s["requests"] > 0 and s["failed"] == s["requests"]
    assert all(r.error.startswith("timeout") for r in read_records(str(tmp_path / "silent" / "records.parquet")))
    # 400 tokens at 20 ms take 8 s; the run waits 1 s after the last send: those still streaming are unfinished
    cfg = LoadConfig(url=stub, rate=5.0, duration=1.0, mix="s=16:400", mix_weights="1", drain_timeout=1.0,
                     out=str(tmp_path / "slow"))
    s = run_loadtest(cfg)
    assert s["requests"] > 0 and s["unfinished"] == s["requests"] and s["attainment"] == 0.0
    records = read_records(str(tmp_path / "slow" / "records.parquet"))
    assert all(r.status == "unfinished" and 0 < r.output_tokens < 400 for r in records)
    assert s["tbt_gaps"] > 0  # their tokens still count in the pooled TBT


def test_locust_web_ui_runs_the_same_workload(stub, tmp_path):
    """`locust -f loadtest/locustfile.py`: options from environment variables and from the start form."""
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        web_port = sk.getsockname()[1]
    env = dict(os.environ, SLOTUNE_MIX=MIX, SLOTUNE_RATE="20", SLOTUNE_DURATION="2s",
               SLOTUNE_OUT=str(tmp_path / "ui"))
    proc = subprocess.Popen([sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py"),
                             "--web-host", "127.0.0.1", "--web-port", str(web_port), "-H", stub],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        page = None
        for _ in range(100):
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{web_port}/", timeout=2).read().decode()
                break
            except OSError:
                time.sleep(0.2)
        assert page is not None and "max_requests" in page  # the custom options are in the start form
        form = urllib.parse.urlencode({"user_count": 1, "spawn_rate": 1, "host": stub, "max_requests": "15",
                                       "seed": "3"}).encode()
        answer = json.load(urllib.request.urlopen(f"http://127.0.0.1:{web_port}/swarm", data=form, timeout=10))
        assert answer["success"], answer
        summary = tmp_path / "ui" / "summary.json"
        deadline = time.monotonic() + 60
        while not summary.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.2)
        s = json.loads(summary.read_text())
        assert s["requests"] == s["completed"] == 15 and s["seed"] == 3 and s["max_requests"] == 15
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)


def imported_modules(path: Path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_loadtest_package_never_imports_engine():
    """loadtest never imports the engine; only the load process's own modules import locust or gevent."""
    load_process_modules = {"locustfile.py", "openloop.py"}
    for path in (REPO / "loadtest").glob("*.py"):
        mods = imported_modules(path)
        assert not mods & {"engine", "torch"}, path
        if path.name not in load_process_modules:
            assert not mods & {"locust", "gevent"}, path


def test_a_server_that_sends_several_tokens_in_one_event_is_counted_by_its_tokens(tmp_path):
    """A server behind sends three tokens an event: each request still gets all its tokens (the server's usage
    agrees), the share of multi-token events is in the summary, and the gaps inside an event are zero."""
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "streaming_stub_server.py"), "--port", "0",
                             "--interval", "0.03", "--tokens-per-event", "3"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = f"http://127.0.0.1:{int(line.split()[1])}"
        cfg = LoadConfig(url=url, rate=4.0, duration=3.0, mix="s=16:9", mix_weights="1", seed=3,
                         out=str(tmp_path / "multi"))
        s = run_loadtest(cfg)
    finally:
        proc.terminate()
        proc.wait(10)
    records = read_records(str(tmp_path / "multi" / "records.parquet"))
    ok = [r for r in records if r.status == "ok"]
    assert ok and all(r.output_tokens == r.max_tokens == 9 == r.usage_tokens for r in ok)
    assert all(r.output_events == 3 and r.multi_token_events == 3 for r in ok)
    assert all(list(np.diff(r.token_times)[[0, 1, 3, 4, 6, 7]]) == [0.0] * 6 for r in ok)
    assert s["multi_token_event_share"] == 1.0 and s["usage_mismatches"] == 0 and s["usage_checked"] == len(ok)
    assert s["gaps_inside_events"] == 6 * len(ok)
