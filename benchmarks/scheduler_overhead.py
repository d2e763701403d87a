#!/usr/bin/env python
"""Scheduling and bookkeeping alone (no model, no torch): the time of `Scheduler.schedule()` + `postprocess()` per
step with 256 running sequences. Target: under 1 ms per step.

Two scenarios, both with `max_num_seqs=256`, `max_num_batched_tokens=2048`, `block_size=16`:

  steady  256 sequences in steady-state decode: prompts of 200-400 tokens (prefilled before timing starts), outputs
          long enough that none finishes while timed, so every timed step schedules 256 decode tokens. Prefix caching
          is on (each completed block is hashed and registered, as in the engine).
  churn   the same, but requests keep finishing and new ones arrive: outputs of 16-256 tokens, a new request is
          queued for every one that finishes (so 256 are in flight, a few waiting), prompts share one of 8 system
          prompts of 256 tokens (+ a unique 16-128 token tail), so admissions hit the prefix cache; timed steps mix
          decode tokens with prefill chunks of new requests.

The KV pool is sized so that nothing is preempted (the engine's real pool would be sized by kv_cache_bytes). Sampled
tokens are drawn ahead of time from a seeded generator so that timing covers the scheduler only.

    python benchmarks/scheduler_overhead.py --out results/scheduler_overhead.json
    python benchmarks/scheduler_overhead.py --quick --out /tmp/sched.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, ModelLimits
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from loadtest.summary import percentile

# SmolLM2-135M: 8192-token context; K+V of 30 layers x 3 heads x 64 dims in fp32.
LIMITS = ModelLimits(max_context_len=8192, kv_bytes_per_token=2 * 30 * 3 * 64 * 4)
VOCAB = 49152
TARGET_MS = 1.0


def timing_percentile(values: list[float], q: float) -> float:
    """The load generator's percentile of step timings, which a run always records."""
    value = percentile(values, q)
    if value is None:
        raise ValueError("no step timings were recorded")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256, help="running sequences (= max_num_seqs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=2000, help="timed steps per scenario")
    p.add_argument("--warmup-steps", type=int, default=50, help="untimed steps after the prefill, per scenario")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per scenario (medians over all steps pooled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-gc", action="store_true", help="disable Python's garbage collector while timing")
    p.add_argument("--quick", action="store_true", help="smoke test: 300 steps, 1 repeat")
    p.add_argument("--out", type=Path, default=Path("scheduler_overhead.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 300)
        args.repeats = 1
    return args


class Harness:
    """Drives a Scheduler the way the engine does, with pre-drawn 'sampled' tokens instead of a model."""

    def __init__(self, args: argparse.Namespace, enable_prefix_caching: bool, num_kv_blocks: int) -> None:
        config = EngineConfig.create(LIMITS, max_num_seqs=args.num_seqs,
                                     max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                                     num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(config, LIMITS)
        self.rng = random.Random(args.seed)
        self.tokens = [self.rng.randrange(100, VOCAB) for _ in range(1 << 16)]
        self.token_pos = 0
        self.counter = 0

    def add(self, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.scheduler.add(Sequence(request_id=f"r{self.counter}", prompt_token_ids=prompt, params=params,
                                    eos_token_ids=frozenset({2})))
        self.counter += 1

    def step(self) -> tuple[float, float, int, int, int]:
        """One step; returns (schedule seconds, postprocess seconds, finished, decode tokens, prefill chunks)."""
        tokens = self.tokens
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        # What the runner would hand back: a token where the step samples, else None (built outside the timing).
        pos = self.token_pos
        sampled: list[int | None] = []
        for item in out.scheduled:
            if item.samples:
                sampled.append(tokens[pos & 0xFFFF])
                pos += 1
            else:
                sampled.append(None)
        self.token_pos = pos
        t2 = time.perf_counter()
        finished = self.scheduler.postprocess(out, sampled)
        t3 = time.perf_counter()
        decode = sum(1 for s in out.scheduled if not s.is_prefill)
        return t1 - t0, t3 - t2, len(finished), decode, len(out.scheduled) - decode



def summarize(sched: list[float], post: list[float], extra: dict[str, Any]) -> dict[str, Any]:
    total = [a + b for a, b in zip(sched, post)]
    ms = 1e3
    return {
        "steps": len(total),
        "median_ms": statistics.median(total) * ms, "p99_ms": timing_percentile(total, 99) * ms,
        "p90_ms": timing_percentile(total, 90) * ms, "max_ms": max(total) * ms, "mean_ms": statistics.fmean(total) * ms,
        "schedule_median_ms": statistics.median(sched) * ms, "schedule_p99_ms": timing_percentile(sched, 99) * ms,
        "postprocess_median_ms": statistics.median(post) * ms, "postprocess_p99_ms": timing_percentile(post, 99) * ms,
        "meets_target": statistics.median(total) * ms < TARGET_MS and timing_percentile(total, 99) * ms < TARGET_MS,
        **extra,
    }


def run_steady(args: argparse.Namespace, rep: int) -> dict[str, Any]:
    rng = random.Random(args.seed + rep)
    total_steps = args.warmup_steps + args.steps
    prompts = [[rng.randrange(100, VOCAB) for _ in range(rng.randint(200, 400))] for _ in range(args.num_seqs)]
    max_tokens = total_steps + 64  # nobody finishes while timed
    blocks_per_seq = -(-(400 + max_tokens) // args.block_size) + 1
    h = Harness(args, enable_prefix_caching=True, num_kv_blocks=args.num_seqs * blocks_per_seq + 64)
    for prompt in prompts:
        h.add(prompt, max_tokens)
    # Prefill everyone (untimed): until all 256 are decoding.
    while any(s.in_prefill for s in h.scheduler.running) or len(h.scheduler.waiting):
        h.step()
    for _ in range(args.warmup_steps):
        h.step()
    sched, post = [], []
    decode_tokens = []
    for _ in range(args.steps):
        s, p, _, d, _ = h.step()
        sched.append(s)
        post.append(p)
        decode_tokens.append(d)
    assert min(decode_tokens) == args.num_seqs, "every timed step should decode all sequences"
    return {"sched": sched, "post": post, "decode_tokens_per_step": statistics.fmean(decode_tokens),
            "prefill_seqs_per_step": 0.0, "finished": 0, "kv_blocks_used_end": h.scheduler.kv.num_used_blocks}


def run_churn(args: argparse.Namespace, rep: int) -> dict[str, Any]:
    rng = random.Random(args.seed + 1000 + rep)
    system_prompts = [[rng.randrange(100, VOCAB) for _ in range(256)] for _ in range(8)]

    def new_request(h: Harness) -> None:
        prompt = rng.choice(system_prompts) + [rng.randrange(100, VOCAB) for _ in range(rng.randint(16, 128))]
        h.add(prompt, rng.randint(16, 256))

    max_len = 256 + 128 + 256
    blocks_per_seq = -(-max_len // args.block_size) + 1
    # Room for every in-flight sequence plus a cached pool of the same size (evicted lazily, LRU).
    h = Harness(args, enable_prefix_caching=True, num_kv_blocks=2 * (args.num_seqs + 16) * blocks_per_seq)
    in_flight_target = args.num_seqs + 8  # a few always waiting, so admissions happen as soon as a slot frees
    for _ in range(in_flight_target):
        new_request(h)
    # Reach a steady mix of ages (untimed): run long enough for the first generation to turn over.
    for _ in range(300 + args.warmup_steps):
        _, _, finished, _, _ = h.step()
        for _ in range(finished):
            new_request(h)
    hits0, queries0 = h.scheduler.prefix_cache_hits, h.scheduler.prefix_cache_queries
    sched, post = [], []
    decode_tokens, prefill_seqs, finished_total = [], [], 0
    for _ in range(args.steps):
        s, p, finished, d, pf = h.step()
        sched.append(s)
        post.append(p)
        decode_tokens.append(d)
        prefill_seqs.append(pf)
        finished_total += finished
        for _ in range(finished):  # arrivals, outside the timing (the engine's add_request is not a step)
            new_request(h)
    queries = h.scheduler.prefix_cache_queries - queries0
    return {"sched": sched, "post": post, "decode_tokens_per_step": statistics.fmean(decode_tokens),
            "prefill_seqs_per_step": statistics.fmean(prefill_seqs), "finished": finished_total,
            "prefix_cache_hit_rate": (h.scheduler.prefix_cache_hits - hits0) / queries if queries else 0.0,
            "preemptions": h.scheduler.num_preemptions, "kv_blocks_used_end": h.scheduler.kv.num_used_blocks}


def run_scenario(args: argparse.Namespace, fn: Any) -> dict[str, Any]:
    sched: list[float] = []
    post: list[float] = []
    per_run = []
    extras: dict[str, list[Any]] = {}
    for rep in range(args.repeats):
        gc.collect()
        if args.no_gc:
            gc.disable()
        try:
            res = fn(args, rep)
        finally:
            gc.enable()
        sched += res.pop("sched")
        post += res.pop("post")
        total = [a + b for a, b in zip(sched[-args.steps:], post[-args.steps:])]
        per_run.append({"median_ms": statistics.median(total) * 1e3, "p99_ms": timing_percentile(total, 99) * 1e3,
                        **res})
        for k, v in res.items():
            extras.setdefault(k, []).append(v)
    summary = summarize(sched, post, {k: (statistics.fmean(v) if all(isinstance(x, (int, float)) for x in v) else v)
                                      for k, v in extras.items()})
    summary["runs"] = per_run
    return summary


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"{report['args']['num_seqs']} sequences, max_num_batched_tokens={report['args']['max_num_batched_tokens']}, "
        f"block_size={report['args']['block_size']}, {report['args']['steps']} timed steps x "
        f"{report['args']['repeats']} runs per scenario, gc {'off' if report['args']['no_gc'] else 'on'}",
        "",
        "| scenario | median ms/step | p99 ms/step | max ms | schedule median / p99 ms | postprocess median / p99 ms "
        "| decode tok/step | target < 1 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in report["scenarios"].items():
        lines.append(
            f"| {name} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} | {r['max_ms']:.3f} | "
            f"{r['schedule_median_ms']:.3f} / {r['schedule_p99_ms']:.3f} | "
            f"{r['postprocess_median_ms']:.3f} / {r['postprocess_p99_ms']:.3f} | "
            f"{r['decode_tokens_per_step']:.1f} | {'yes' if r['meets_target'] else 'no'} |")
    churn = report["scenarios"].get("churn")
    if churn:
        lines += ["", f"churn: {churn['finished']:.0f} requests finished (and as many admitted) per run, "
                      f"{churn['prefill_seqs_per_step']:.2f} prefill chunks per step, "
                      f"prefix-cache hit rate {churn['prefix_cache_hit_rate']:.1%}, "
                      f"preemptions {churn['preemptions']:.0f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "env": {"python": platform.python_version(), "platform": platform.platform(),
                "loadavg_start": list(__import__("os").getloadavg())},
        "target_ms": TARGET_MS,
        "scenarios": {},
    }
    assert "torch" not in sys.modules, "the scheduler must not need torch"
    report["scenarios"]["steady"] = run_scenario(args, run_steady)
    report["scenarios"]["churn"] = run_scenario(args, run_churn)
    report["torch_imported"] = "torch" in sys.modules
    report["env"]["loadavg_end"] = list(__import__("os").getloadavg())
    table = markdown(report)
    report["markdown"] = table
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
