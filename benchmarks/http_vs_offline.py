#!/usr/bin/env python
"""Output tokens/s of the same mixed workload through `slotune serve` (HTTP, streamed, one SSE event per token)
and through the offline engine (`engine.LLM.generate`), with the same knobs. Target: HTTP >= 90% of offline.

The workload: `--num-requests` requests (seeded), short / medium / long in 6:3:1 (exact counts, shuffled), prompts
of random token ids of exact length, outputs of exact length (greedy, EOS ignored), so both paths produce the same
tokens. Lengths (prompt / output, uniform, inclusive, times `--length-scale`): short 16-64 / 16-64, medium
128-256 / 64-128, long 512-1024 / 128-256.

Offline: one warm-up `generate` of a same-shaped workload, then `--repeats` timed `generate` calls over the whole
workload in this process, in a worker thread like the server's engine loop (`--offline-main-thread` to change). HTTP: one `slotune serve` subprocess with the same knobs, warmed up the same way; each
repeat sends every request at once as a streamed `/v1/completions` call (token-id prompt) from an asyncio client
in this process and counts token events; the time runs from the first send to the last event. Repeats alternate
offline and HTTP so that drift in the machine's load hits both; medians and per-repeat ratios are reported, and
the share of the wall time spent inside engine steps (from the step records) shows where any gap comes from.

    python benchmarks/http_vs_offline.py --out results/http_vs_offline.json
    python benchmarks/http_vs_offline.py --quick --out /tmp/http_vs_offline.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLASSES: dict[str, tuple[int, int, int, int]] = {
    "short": (16, 64, 16, 64),
    "medium": (128, 256, 64, 128),
    "long": (512, 1024, 128, 256),
}
MIX = {"short": 6, "medium": 3, "long": 1}
FIRST_PLAIN_TOKEN = 100  # random prompt tokens are drawn above the special tokens
TARGET_RATIO = 0.90
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Request:
    kind: str
    prompt: list[int]
    max_tokens: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or .gguf; default: the engine's default model")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of both the offline engine and the server (default: all cores)")
    p.add_argument("--quick", action="store_true", help="smoke test: 16 requests, lengths x 1/4, one repeat")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--offline-main-thread", action="store_true",
                   help="run the offline engine in the main thread (default: in a worker thread, as the server)")
    p.add_argument("--out", type=Path, default=Path("http_vs_offline.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.length_scale, args.repeats = 16, 0.25, 1
    return args


def knobs(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "block_size": args.block_size, "kv_cache_bytes": args.kv_cache_bytes,
            # No prefix-cache hits between repeats: every run computes the same tokens.
            "enable_prefix_caching": False}


def make_workload(n: int, seed: int, scale: float, vocab_size: int) -> list[Request]:
    rng = random.Random(seed)
    total = sum(MIX.values())
    counts = {k: n * v // total for k, v in MIX.items()}
    counts["short"] += n - sum(counts.values())
    kinds = [k for k, c in counts.items() for _ in range(c)]
    rng.shuffle(kinds)
    requests = []
    for kind in kinds:
        p_lo, p_hi, o_lo, o_hi = (max(1, round(x * scale)) for x in CLASSES[kind])
        prompt = [rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(rng.randint(p_lo, p_hi))]
        requests.append(Request(kind, prompt, rng.randint(o_lo, o_hi)))
    return requests


# Offline ------------------------------------------------------------------------------------------------------
def run_offline(llm: Any, requests: list[Request], in_thread: bool = True) -> dict[str, Any]:
    """`LLM.generate` over the workload, by default in a fresh thread: on this project's CPU machines torch runs
    several times slower in the main thread than in any other (see BENCHMARKS.md), and the server's engine loop
    runs in a thread of its own, so a main-thread baseline would flatter the server."""
    if in_thread:
        result: list[Any] = []
        worker = threading.Thread(target=lambda: result.append(_run_offline(llm, requests)))
        worker.start()
        worker.join()
        return result[0]
    return _run_offline(llm, requests)


def _run_offline(llm: Any, requests: list[Request]) -> dict[str, Any]:
    from engine import SamplingParams

    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
    records = llm.step_records()
    last = records[-1].step if records else -1
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = [r.to_dict() for r in llm.step_records(last)]
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall, **step_stats(steps, wall),
            "texts": [o.text for o in outputs]}


def step_stats(steps: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """How the wall time splits: inside engine steps (`busy`) and between them (idle, overhead)."""
    busy = sum(s["total_s"] for s in steps)
    return {"steps": len(steps), "step_busy_s": busy, "step_busy_share": busy / wall if wall else 0.0,
            "median_step_ms": 1000 * statistics.median(s["total_s"] for s in steps) if steps else 0.0}


# HTTP ---------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str, Path]:
    import httpx

    from engine.knobs import KNOB_BY_NAME, flag_words  # the knob schema: each knob's flag

    port = free_port()
    flags = []
    for name, value in knobs(args).items():
        flags += flag_words(KNOB_BY_NAME[name].flag, value, negate_bools=False)
    if args.model:
        flags += ["--model", args.model]
    log = Path(tempfile.mkdtemp(prefix="slotune-bench-")) / "serve.log"
    process = subprocess.Popen([sys.executable, "-m", "slotune.cli", "serve", "--port", str(port),
                                "--log-level", "warning", *flags], cwd=REPO, stdout=log.open("wb"),
                               stderr=subprocess.STDOUT,
                               env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                    "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"slotune serve exited: {log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return process, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise TimeoutError("slotune serve did not start")


async def _stream_one(http: Any, request: Request) -> tuple[int, str, float]:
    body = {"prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events, parts = 0, []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event["choices"]:
                events += 1
                parts.append(choice["text"])
    return events, "".join(parts), time.perf_counter()


def run_http(url: str, requests: list[Request]) -> dict[str, Any]:
    import httpx

    async def go() -> tuple[float, list[tuple[int, str, float]]]:
        limits = httpx.Limits(max_connections=len(requests) + 8)
        async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
            start = time.perf_counter()
            results = await asyncio.gather(*(_stream_one(http, r) for r in requests))
            return start, results

    last = httpx.get(url + "/health", timeout=30).json()["last_step"]
    start, results = asyncio.run(go())
    wall = max(r[2] for r in results) - start
    tokens = sum(r[0] for r in results)
    steps = httpx.get(url + "/debug/steps", params={"since": last}, timeout=60).json()["steps"]
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall, **step_stats(steps, wall),
            "texts": [r[1] for r in results]}


# Report -------------------------------------------------------------------------------------------------------
def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
            "wall_s_median": statistics.median(r["wall_s"] for r in runs),
            "step_busy_share_median": statistics.median(r["step_busy_share"] for r in runs),
            "median_step_ms": statistics.median(r["median_step_ms"] for r in runs),
            "output_tokens": runs[0]["output_tokens"],
            "runs": [{k: v for k, v in r.items() if k != "texts"} for r in runs]}


def table(report: dict[str, Any]) -> str:
    lines = [f"{'path':<10} {'requests':>8} {'out tokens':>10} {'wall s':>8} {'tok/s':>8} {'in steps':>9} "
             f"{'step ms':>8}", "-" * 67]
    for name in ("offline", "http"):
        s = report[name]
        lines.append(f"{name:<10} {report['workload']['num_requests']:>8} {s['output_tokens']:>10} "
                     f"{s['wall_s_median']:>8.2f} {s['tokens_per_s_median']:>8.1f} "
                     f"{100 * s['step_busy_share_median']:>8.1f}% {s['median_step_ms']:>8.1f}")
    pairs = ", ".join(f"{h['tokens_per_s'] / o['tokens_per_s']:.3f}"
                      for o, h in zip(report["offline"]["runs"], report["http"]["runs"]))
    lines.append(f"\nper-repeat HTTP / offline: {pairs}")
    lines.append(f"HTTP / offline (medians) = {report['ratio']:.3f} (target >= {TARGET_RATIO:.2f}: "
                 f"{'met' if report['ratio'] >= TARGET_RATIO else 'NOT met'}); greedy texts equal in "
                 f"{report['texts_equal']}/{report['workload']['num_requests']} requests")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from engine import LLM  # first: the engine sets OpenMP's wait policy before torch loads it

    import torch  # noqa: I001

    torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    log("loading the offline engine")
    llm = LLM(args.model, **knobs(args))
    vocab = llm.engine.model_config.vocab_size
    requests = make_workload(args.num_requests, args.seed, args.length_scale, vocab)
    # Warm-up: the whole workload once per path (first-time shapes are several times slower on CPU).
    warm = make_workload(args.num_requests, args.seed + 1, args.length_scale, vocab)
    log("starting slotune serve")
    process, url, server_log = start_server(args)
    try:
        in_thread = not args.offline_main_thread
        run_offline(llm, warm, in_thread)
        run_http(url, warm)
        offline_runs, http_runs = [], []
        for i in range(args.repeats):
            offline_runs.append(run_offline(llm, requests, in_thread))
            log(f"repeat {i + 1}: offline {offline_runs[-1]['tokens_per_s']:.1f} tok/s")
            http_runs.append(run_http(url, requests))
            log(f"repeat {i + 1}: http {http_runs[-1]['tokens_per_s']:.1f} tok/s")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
    offline, http = summarize(offline_runs), summarize(http_runs)
    equal = sum(a == b for a, b in zip(offline_runs[-1]["texts"], http_runs[-1]["texts"]))
    report = {
        "benchmark": "http_vs_offline",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "knobs": knobs(args), "threads": args.threads,
        "offline_runs_in": "main thread" if args.offline_main_thread else "worker thread",
        "workload": {"num_requests": len(requests), "seed": args.seed, "length_scale": args.length_scale,
                     "prompt_tokens": sum(len(r.prompt) for r in requests),
                     "output_tokens": sum(r.max_tokens for r in requests),
                     "by_kind": {k: sum(r.kind == k for r in requests) for k in CLASSES}},
        "offline": offline, "http": http,
        "ratio": http["tokens_per_s_median"] / offline["tokens_per_s_median"],
        "target_ratio": TARGET_RATIO, "texts_equal": equal,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "loadavg_end": os.getloadavg()},
    }
    report["target_met"] = report["ratio"] >= TARGET_RATIO
    print(table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
