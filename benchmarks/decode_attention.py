#!/usr/bin/env python
"""Decode attention over the paged KV cache: the engine's C++ kernel (engine/csrc/decode_attention.cpp)
against the path torch's own ops take (engine/attention.py without the kernels: gather the blocks, then
`scaled_dot_product_attention` with a mask), side by side in one process, on SmolLM2's heads (9 query heads over
3 KV heads of 64), 30 layers' caches per step (as a forward pass reads them: each layer's cache is read once, from
DRAM), blocks of 16 tokens shuffled across the pool.

For each shape: ms per step (30 calls) of both, the kernel's share of the torch path, and the bytes of cache the
step reads per second. A second kernel figure reads one layer's cache 30 times (it stays in the caches): the gap
between the two is the time the kernel waits for memory.

    python benchmarks/decode_attention.py --out results/decode_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine import fused_layers
from engine.attention import AttentionMetadata, DecodeGroup, paged_attention

SHAPES = [(1, 200), (1, 1000), (1, 4000), (4, 300), (8, 400), (32, 300), (64, 200)]  # (sequences, context tokens)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=9, help="timed steps per system and shape (medians reported)")
    p.add_argument("--out", type=Path, default=Path("decode_attention.json"))
    return p.parse_args(argv)


def time_step(attend: Any, layers: int, repeats: int) -> float:
    """Median seconds of one step: `attend(layer)` for every layer."""
    times = []
    for _ in range(repeats + 1):  # the first warms up
        start = time.perf_counter()
        for layer in range(layers):
            attend(layer)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def run_shape(kernels: Any, seqs: int, context: int, args: argparse.Namespace) -> dict[str, Any]:
    heads, kv_heads, dim, bs = 9, 3, 64, args.block_size
    generator = torch.Generator().manual_seed(seqs * 10_000 + context)
    blocks_per_seq = -(-context // bs)
    num_blocks = seqs * blocks_per_seq + 1
    keys = [torch.randn(num_blocks, bs, kv_heads, dim, generator=generator) for _ in range(args.layers)]
    values = [torch.randn(num_blocks, bs, kv_heads, dim, generator=generator) for _ in range(args.layers)]
    tables = (torch.randperm(num_blocks - 1, generator=generator) + 1).view(seqs, blocks_per_seq)
    lens = torch.full((seqs,), context)
    query = torch.randn(seqs, heads, dim, generator=generator)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long),
                             decode_groups=[DecodeGroup(0, seqs, tables, context, None, lens)])
    scale = dim ** -0.5
    unused = query[:, :kv_heads]

    def kernel(layer: int) -> torch.Tensor:
        return kernels.decode_attention(query, keys[layer], values[layer], tables, lens, scale)

    def torch_path(layer: int) -> torch.Tensor:
        return paged_attention(query, unused, unused, keys[layer], values[layer], meta, scale, None)

    torch.testing.assert_close(kernel(0), torch_path(0), rtol=1e-4, atol=1e-5)
    cache_bytes = args.layers * seqs * context * kv_heads * dim * 4 * 2
    # alternate the two systems, so that a change of the machine's state falls on both
    kernel_s, torch_s, hot_s = [], [], []
    for _ in range(3):
        kernel_s.append(time_step(kernel, args.layers, args.repeats))
        torch_s.append(time_step(torch_path, args.layers, args.repeats))
        hot_s.append(time_step(lambda layer: kernel(0), args.layers, args.repeats))
    k, t, h = statistics.median(kernel_s), statistics.median(torch_s), statistics.median(hot_s)
    return {"seqs": seqs, "context": context, "cache_bytes_per_step": cache_bytes, "kernel_s": k, "torch_s": t,
            "kernel_over_torch": k / t, "kernel_gb_per_s": cache_bytes / k / 1e9, "kernel_one_layer_cached_s": h,
            "kernel_one_layer_cached_gb_per_s": cache_bytes / h / 1e9}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = fused_layers.load()
    if kernels is None:
        print("the C++ kernels are not available (SLOTUNE_FUSED_LAYERS=0 or no compiler)", file=sys.stderr)
        return 1
    rows = [run_shape(kernels, seqs, context, args) for seqs, context in SHAPES]
    lines = [f"Decode attention, {args.layers} layers per step, 9 query / 3 KV heads of 64, block {args.block_size}, "
             f"{args.threads} threads",
             "", "| sequences x context | kernel ms | torch path ms | kernel / torch | kernel GB/s | "
             "kernel, one layer's cache 30x: ms | GB/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['seqs']} x {r['context']} | {r['kernel_s'] * 1e3:.2f} | {r['torch_s'] * 1e3:.2f} | "
                     f"{r['kernel_over_torch']:.2f}x | {r['kernel_gb_per_s']:.1f} | "
                     f"{r['kernel_one_layer_cached_s'] * 1e3:.2f} | {r['kernel_one_layer_cached_gb_per_s']:.1f} |")
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "shapes": rows,
                                    "markdown": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
