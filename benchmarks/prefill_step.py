#!/usr/bin/env python
"""The time of a prefill step: `--prompts` fresh prompts of `--tokens` token ids, one after another, each generating
1 token (one step per `--max-num-batched-tokens` of prompt), the first one a warm-up; prints the median and each.

    python benchmarks/prefill_step.py --dtype bfloat16 --tokens 512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402  (first: the engine sets OpenMP's wait policy before torch loads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = parser.parse_args(argv)
    llm = LLM(dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=args.max_num_batched_tokens)
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = [[(i * 7919 + j * 31) % 40000 + 100 for j in range(args.tokens)] for i in range(args.prompts)]
    llm.generate(prompts[0], one_token)
    times = []
    for prompt in prompts[1:]:
        start = time.perf_counter()
        llm.generate(prompt, one_token)
        times.append(time.perf_counter() - start)
    print(f"{args.dtype}, {args.tokens}-token prompts: median {statistics.median(times) * 1e3:.1f} ms "
          f"({', '.join(f'{t * 1e3:.0f}' for t in times)})")


if __name__ == "__main__":
    main()
