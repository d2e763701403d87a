#!/usr/bin/env python
"""The spread of the engine's batch-1 decode step, offline (no server, no load generator): the floor under any
p99 TBT the tuner can reach on this machine. A 50 ms p99 TBT needs fewer than 1% of decode steps above 50 ms.

    python benchmarks/decode_jitter.py --requests 8 --tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch

from engine import LLM, SamplingParams
from loadtest.summary import percentile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", help="auto: the engine's default choice")
    p.add_argument("--requests", type=int, default=8, help="requests run one after another (batch 1)")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--slo-ms", type=float, default=50.0)
    p.add_argument("--no-gc", action="store_true", help="disable Python's garbage collector while timing")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = LLM(model=None, dtype=args.dtype)
    prompt = list(range(1000, 1000 + args.prompt))
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))  # warm-up
    if args.no_gc:
        gc.disable()
    first = len(llm.step_records())
    for _ in range(args.requests):
        llm.generate([prompt], params)
    steps = [r for r in llm.step_records()[first:] if r.num_prefill_tokens == 0]
    ms = sorted(r.total_s * 1e3 for r in steps)
    result = {
        "threads": args.threads, "dtype": args.dtype, "decode_steps": len(ms),
        "p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90), "p99_ms": percentile(ms, 99), "max_ms": ms[-1],
        "share_above_slo": sum(1 for x in ms if x > args.slo_ms) / len(ms), "slo_ms": args.slo_ms,
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
