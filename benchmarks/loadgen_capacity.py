"""How many concurrent streams and tokens/s one load-generator process times accurately on this machine.

Runs `slotune loadtest`'s machinery (one headless Locust process, the open-loop dispatcher) against the trivial
streaming server of the tests (tests/streaming_stub_server.py) on loopback. The server behaves like a batching
engine with a fixed step: every ``--interval`` it writes one token to every running stream, and it logs the
time it wrote each token. For each target concurrency C the generator sends requests at a constant rate
``C / (tokens * interval)``, so that C streams are open in the steady state and C / interval tokens arrive per
second, and the benchmark compares, token by token, the time the client recorded with the time the server wrote
(same machine, same clock). "Accurate": timing error p99 <= --max-error (default 2.5 ms, 5% of a 50 ms TBT target), send lag p99 <= 10 ms,
every request completed.

    python benchmarks/loadgen_capacity.py                        # the default sweep, a table, JSON in /tmp
    python benchmarks/loadgen_capacity.py --streams 50 200 800 --duration 10 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.config import LoadConfig
from loadtest.records import read_records
from loadtest.runner import run_loadtest


def start_stub(interval: float, realtime: bool) -> tuple[subprocess.Popen, str]:
    def rt() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))
        except OSError:
            pass

    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "streaming_stub_server.py"), "--port", "0",
                             "--interval", str(interval)], stdout=subprocess.PIPE, text=True,
                            preexec_fn=rt if realtime else None)
    line = proc.stdout.readline() if proc.stdout is not None else ""  # stdout is a pipe: never None
    if not line.startswith("LISTENING"):
        raise RuntimeError(f"stub server did not start: {line!r}")
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


def server_log(url: str) -> dict:
    with urllib.request.urlopen(url + "/stats?tokens=1", timeout=60) as r:
        return json.load(r)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    """CPU seconds of this process's finished children: the Locust process once run_loadtest has reaped it."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def one(url: str, streams: int, tokens: int, interval: float, duration: float, realtime: bool, out: str,
        stub_pid: int) -> dict:
    lifetime = tokens * interval
    rate = streams / lifetime
    before = set(server_log(url)["requests"])
    cfg = LoadConfig(url=url, workload="mixed", mix=f"s=16:{tokens}", mix_weights="1", rate=rate,
                     arrival="constant", duration=duration, drain_timeout=lifetime * 3 + 10, out=out, seed=1)
    stub_cpu0, gen_cpu0, (busy0, total0) = cpu_seconds(stub_pid), children_cpu(), machine_ticks()
    t0 = time.monotonic()
    s = run_loadtest(cfg, workers=1, realtime=realtime)
    wall = time.monotonic() - t0
    stub_cpu, gen_cpu = cpu_seconds(stub_pid) - stub_cpu0, children_cpu() - gen_cpu0
    busy1, total1 = machine_ticks()
    log = server_log(url)
    server = {k: v for k, v in log["requests"].items() if k not in before}
    recs = read_records(os.path.join(out, "records.parquet"))
    errs: list[np.ndarray] = []
    gap_diffs: list[np.ndarray] = []
    for r in recs:
        srv = server.get(r.id)
        if srv is None or not r.token_times:
            continue
        n = min(len(r.token_times), len(srv["tokens"]))
        c, w = np.array(r.token_times[:n]), np.array(srv["tokens"][:n])
        errs.append(c - w)
        gap_diffs.append(np.abs(np.diff(c) - np.diff(w)))
    err = np.concatenate(errs) if errs else np.zeros(0)
    gap_diff = np.concatenate(gap_diffs) if gap_diffs else np.zeros(0)
    # the steady state: requests scheduled after the first lifetime, before the last one
    steady = [r for r in recs if lifetime <= r.scheduled_at < duration - lifetime]
    def pct(a: np.ndarray, q: float) -> float | None:
        return float(np.percentile(a, q)) if a.size else None

    return {
        "streams": streams, "tokens_per_s": streams / interval, "rate_rps": rate, "requests": s["requests"],
        "completed": s["completed"], "failed": s["failed"], "unfinished": s["unfinished"],
        "send_lag_p50": s["send_lag_p50"], "send_lag_p99": s["send_lag_p99"], "send_lag_max": s["send_lag_max"],
        "timing_error_p50": pct(err, 50), "timing_error_p99": pct(err, 99), "timing_error_max": pct(err, 100),
        "gap_error_p99": pct(gap_diff, 99), "tbt_p50": s["tbt_p50"], "tbt_p99": s["tbt_p99"],
        "measured_tokens_per_s": (sum(len(r.token_times) for r in steady) / max(len(steady), 1)) * rate,
        "server_max_active": log["max_active"], "stub_cpu_s": stub_cpu, "wall_s": wall,
        "generator_cpu_s": gen_cpu, "tokens": int(sum(len(r.token_times) for r in recs)),
        "machine_busy": (busy1 - busy0) / max(total1 - total0, 1),
        "scheduling": s.get("load_process_scheduling"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[25, 50, 100, 200, 400, 800, 1600])
    p.add_argument("--tokens", type=int, default=100, help="output tokens per request")
    p.add_argument("--interval", type=float, default=0.02, help="server step: seconds between a stream's tokens")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of schedule per point")
    p.add_argument("--max-error", type=float, default=0.0025,
                   help="token timing error p99 that still counts as accurate (default 2.5 ms: 5%% of a 50 ms TBT target)")
    p.add_argument("--realtime", action="store_true",
                   help="SCHED_RR load process (see slotune loadtest --realtime)")
    p.add_argument("--server-realtime", action="store_true", help="SCHED_RR streaming server too")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "loadgen_capacity.json"))
    a = p.parse_args(argv)

    stub, url = start_stub(a.interval, a.server_realtime)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            # a point with a single stream: the generator's CPU time without load (start-up, idle loop)
            base = one(url, 1, a.tokens, a.interval, a.duration, a.realtime, os.path.join(tmp, "base"), stub.pid)
            for c in a.streams:
                row = one(url, c, a.tokens, a.interval, a.duration, a.realtime, os.path.join(tmp, f"c{c}"), stub.pid)
                extra_tokens = row["tokens"] - base["tokens"]
                row["cpu_per_token_us"] = ((row["generator_cpu_s"] - base["generator_cpu_s"]) / extra_tokens * 1e6
                                           if extra_tokens > 0 else None)
                row["accurate"] = bool(
                    row["failed"] == 0 and row["unfinished"] == 0 and row["timing_error_p99"] is not None
                    and row["timing_error_p99"] <= a.max_error and (row["send_lag_p99"] or 0) <= 0.010)
                rows.append(row)
                def ms(v: float | None) -> str:
                    return "-" if v is None else f"{v * 1e3:.2f}"

                print(f"streams {c:5d}  tokens/s {row['tokens_per_s']:6.0f}  send lag p99 {ms(row['send_lag_p99']):>6}ms  "
                      f"token timing error p50/p99/max {ms(row['timing_error_p50'])}/{ms(row['timing_error_p99'])}/"
                      f"{ms(row['timing_error_max'])}ms  gap error p99 {ms(row['gap_error_p99'])}ms  "
                      f"ok {row['completed']}/{row['requests']}  generator cpu/token "
                      f"{row['cpu_per_token_us'] or 0:.0f}us  machine busy {row['machine_busy']:.0%}  "
                      f"{'accurate' if row['accurate'] else 'NOT accurate'}", flush=True)
    finally:
        stub.terminate()
        stub.wait(10)
    best = max((r for r in rows if r["accurate"]), key=lambda r: r["streams"], default=None)
    costs = [r["cpu_per_token_us"] for r in rows if r["cpu_per_token_us"]]
    cost = float(np.median(costs)) if costs else None
    result = {"machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
              "params": vars(a), "baseline": base, "points": rows, "cpu_per_token_us": cost,
              "saturation_tokens_per_s": 1e6 / cost if cost else None,
              "max_accurate_streams": best and best["streams"], "max_accurate_tokens_per_s": best and best["tokens_per_s"]}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\none generator process times accurately up to {result['max_accurate_streams']} concurrent streams, "
          f"{result['max_accurate_tokens_per_s']} tokens/s (token timing error p99 <= {a.max_error * 1e3:g} ms, "
          f"send lag p99 <= 10 ms); it spends ~{cost or 0:.0f} us of CPU per token (one core would saturate near "
          f"{result['saturation_tokens_per_s'] or 0:.0f} tokens/s); results in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
