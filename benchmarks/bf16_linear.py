#!/usr/bin/env python
"""The engine's bf16 matrix kernels against each other and against torch's, per row count, over a decoder's matrices
larger than the last-level cache (SmolLM2's gate/up and down shapes, `--megabytes` of fp32 weights and the same
matrices in bf16), each kernel's pass over all of them timed in turn, alternating, `--rounds` rounds of
`--repeats` passes; per round the median pass, then the median over rounds and each ratio paired by round.

Kernels: `fp32` (the engine's fp32 `linear`: streaming GEMV up to 6 rows, register tiles up to the measured limit,
BLAS above), `bf16-widen` and `bf16-dot` (the engine's plain-weight bf16 kernels at every row count: the weights
widened to fp32, or AVX512-BF16 dot products), `bf16-vnni` (AVX512-BF16 register tiles on packed weights) and
`bf16-amx` (AMX tiles on packed weights), each where the CPU has its instructions, and `onednn` (torch's bf16 `linear`
with the input rounded to bf16 and the output widened). Ratios are to the kernel the engine uses here.

    python benchmarks/bf16_linear.py --out results/bf16_linear.json
    python benchmarks/bf16_linear.py --rows 1 16 512 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import fused_layers  # noqa: E402  (first: the engine sets OpenMP's wait policy before torch loads it)
import torch  # noqa: E402,I001
from vllm_cpu_peer import cpu_description  # noqa: E402  (this folder is on sys.path when run as a script)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    parser.add_argument("--megabytes", type=int, default=64, help="fp32 weights streamed per pass")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="passes per kernel per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    module = fused_layers.load()
    if module is None:
        raise SystemExit("the engine's C++ kernels could not be built (g++ and ninja are needed)")
    fp32 = fused_layers._decoder_weights(args.megabytes << 20, torch.float32)
    plain = [w.bfloat16() for w in fp32]
    packed = [module.pack_vnni_weight(w) for w in plain] if module.bf16_dot_supported() else []
    default = f"bf16-{fused_layers.bf16_kernel_name(module)}"
    available = {"widen": True, "dot": module.bf16_dot_supported(), "vnni": module.bf16_dot_supported(),
                 "amx": module.amx_supported()}
    weights: dict[str, list[torch.Tensor]] = {"fp32": fp32}
    linears: dict[str, Any] = {"fp32": lambda x, w: module.linear(x, w, None, None)}
    for kernel in (k for k, there in available.items() if there):
        weights[f"bf16-{kernel}"] = packed if kernel in fused_layers.PACKED_KERNELS else plain
        linears[f"bf16-{kernel}"] = engine_linear(module, kernel, default)
    weights["onednn"] = plain
    linears["onednn"] = lambda x, w: torch.nn.functional.linear(x.bfloat16(), w).float()
    names = list(weights)
    module.set_tiled_rows_limit(1 << 30, True)  # the plain-weight kernels at every row count
    results: dict[str, Any] = {"cpu": cpu_description(), "threads": args.threads, "megabytes_fp32": args.megabytes,
                               "bf16_kernel": fused_layers.bf16_kernel_name(module), "rows": {}}
    print(f"{results['cpu']['name']}, {args.threads} threads; ms per pass over {args.megabytes} MB of fp32 matrices "
          f"(bf16: half); median over {args.rounds} rounds")
    print(f"{'rows':>5} " + " ".join(f"{name:>11}" for name in names) + f"   time / {default}'s (paired by round)")
    for m in args.rows:
        rounds = [fused_layers._median_times([linears[n] for n in names], [weights[n] for n in names], m, args.repeats)
                  for _ in range(args.rounds)]
        medians = {n: statistics.median(r[i] for r in rounds) * 1e3 for i, n in enumerate(names)}
        entry: dict[str, Any] = {"ms": medians, "per_round_ms": {n: [r[i] * 1e3 for r in rounds]
                                                                  for i, n in enumerate(names)}}
        line = f"{m:>5} " + " ".join(f"{medians[n]:>11.2f}" for n in names)
        chosen = names.index(default)
        entry["time_over_default"] = {n: statistics.median(r[i] / r[chosen] for r in rounds)
                                      for i, n in enumerate(names) if i != chosen}
        line += "   " + ", ".join(f"{n} {v:.2f}x" for n, v in entry["time_over_default"].items())
        results["rows"][str(m)] = entry
        print(line, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


def engine_linear(module: Any, kernel: str, default: str) -> Any:
    """The engine's `linear` with `kernel` as its bf16 kernel for the call."""
    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        module.set_bf16_kernel(kernel)
        try:
            return module.linear(x, w, None, None)
        finally:
            module.set_bf16_kernel(default.removeprefix("bf16-"))
    return linear


if __name__ == "__main__":
    main()
