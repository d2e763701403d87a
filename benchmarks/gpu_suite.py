#!/usr/bin/env python
"""The engine on one GPU, in one prepared run (under 8 minutes on one GPU), writing one JSON result:

  1. greedy equivalence: the engine (fp32 on the GPU, its default kernel backend there: the Triton kernels) against
     transformers' `generate` (fp32 on the same GPU, TF32 off) on fixed prompts, token for token; the same in bf16
     is reported as the share of identical outputs (two bf16 implementations round differently, so it is
     informational);
  2. throughput (bf16 unless --dtype): the mixed 6:3:1 workload of benchmarks/engine_throughput.py (its workload, engine driver and
     transformers continuous-batching driver, reused), engine against transformers' continuous batching on the same
     GPU in bf16, in alternating repeats (target: >= 2x);
  3. the batch-1 decode step: median `total_s` of a lone request's decode steps (bf16; CUDA graphs on and off in
     alternating runs) against the HBM bound, weight bytes per forward / bandwidth measured by a large device-to-
     device copy (target: within 1.5x).

    python benchmarks/gpu_suite.py --out results/gpu_suite.json
    python benchmarks/gpu_suite.py --device cpu --smoke --out /tmp/gpu_suite_smoke.json   # the script itself, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_throughput as et  # noqa: E402  (the workload and the two drivers)

TARGETS = {"engine_vs_hf_cb": 2.0, "batch1_step_vs_bound": 1.5}
GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about autumn leaves falling on a quiet river.",
    "Explain photosynthesis step by step for a ten-year-old. " * 4,
    "import numpy as np\nimport pandas as pd\n" * 12,
    "Once upon a time in a small village by the sea, there lived an old fisherman who " * 6,
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script itself (e.g. on a CPU)")
    p.add_argument("--model", default=None)
    p.add_argument("--kernel-backend", default="auto", help="engine kernel_backend (auto: triton on a GPU)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="of the throughput and batch-1 parts (the greedy check runs fp32 and bf16)")
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--greedy-prompts", type=int, default=len(GREEDY_PROMPTS))
    p.add_argument("--greedy-dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-bytes", type=int, default=8 << 30)
    p.add_argument("--batch1-tokens", type=int, default=256)
    p.add_argument("--batch1-repeats", type=int, default=4)
    p.add_argument("--copy-gib", type=float, default=4.0, help="size of the bandwidth test's copied tensor")
    p.add_argument("--skip", nargs="*", default=[], choices=["greedy", "throughput", "batch1"])
    p.add_argument("--out", type=Path, default=Path("gpu_suite.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.greedy_tokens, args.greedy_prompts, args.num_requests, args.repeats = 8, 2, 8, 1
        if args.device == "cpu":  # the engine's fast CPU path; bf16 on the CPU is the slow torch path
            args.dtype, args.greedy_dtypes = "float32", ["float32"]
        args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_bytes = 8, 256, 512 << 20
        args.batch1_tokens, args.batch1_repeats, args.copy_gib = 16, 2, 0.25
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def synchronize(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_copy_bandwidth(torch: Any, device: str, gib: float, passes: int = 10) -> dict[str, Any]:
    """Device memory bandwidth: best of `passes` copies of a `gib` GiB tensor into another (read + write bytes)."""
    src = torch.ones(int(gib * (1 << 30)) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * src.element_size()
    times = []
    for _ in range(passes + 1):  # the first pass warms up
        synchronize(torch, device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(torch, device)
        times.append(time.perf_counter() - start)
    del src, dst
    best = min(times[1:])
    return {"bytes_moved_per_copy": moved, "best_s": best, "median_s": et.median(times[1:]),
            "bytes_per_s": moved / best, "gb_per_s": moved / best / 1e9}


def engine(args: argparse.Namespace, dtype: str, **knobs: Any) -> Any:
    from engine import LLM

    return LLM(model=args.model, dtype=dtype, device=args.device, kernel_backend=args.kernel_backend, **knobs)


def greedy_check(args: argparse.Namespace, torch: Any, model_dir: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from engine import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    texts = GREEDY_PROMPTS[: args.greedy_prompts]
    result: dict[str, Any] = {"tokens": args.greedy_tokens, "prompts": len(texts)}
    for dtype in args.greedy_dtypes:
        llm = engine(args, dtype, max_num_seqs=16, max_num_batched_tokens=256, chunk_size=64)
        prompts = [list(llm.tokenizer(p)["input_ids"]) for p in texts]
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0))
        got = [list(o.token_ids) for o in outs]
        backend = llm.engine.kernel_backend
        del llm
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(args.device).eval()
        expected = []
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([prompt], device=args.device)
                new = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.greedy_tokens,
                                  do_sample=False)
                expected.append(new[0, len(prompt):].tolist())
        del hf
        same = [g == e for g, e in zip(got, expected)]
        result[dtype] = {"kernel_backend": backend, "identical": all(same), "identical_share": sum(same) / len(same),
                         "differing_prompts": [i for i, s in enumerate(same) if not s]}
        log(f"greedy {dtype}: {sum(same)}/{len(same)} identical to transformers ({backend})")
    return result


def throughput(args: argparse.Namespace, torch: Any, model_dir: Path, vocab_size: int) -> dict[str, Any]:
    """engine_throughput's engine and transformers-CB drivers on its mixed workload, on args.device in args.dtype
    (the engine's kernel_backend: auto)."""
    et_args = et.parse_args(["--device", args.device, "--dtype", args.dtype, "--num-requests",
                             str(args.num_requests), "--max-num-seqs", str(args.max_num_seqs),
                             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--kv-cache-bytes",
                             str(args.kv_cache_bytes), "--repeats", str(args.repeats)]
                            + (["--length-scale", "0.25"] if args.smoke else []))
    et_args.model = args.model
    requests = et.make_workload(et_args.num_requests, et_args.seed, et_args.length_scale, vocab_size)
    warm = et.warmup_workload(vocab_size, et_args.seed)
    systems: list[et.System] = [et.EngineSystem(et_args, requests),
               et.HFContinuousBatchingSystem(et_args, et.load_hf_model(et_args, model_dir, torch), requests, torch)]
    for system in systems:
        log(f"{system.name}: warm-up")
        system.warm_up(warm)
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
    for rep in range(args.repeats):
        for system in systems[rep % 2:] + systems[: rep % 2]:  # alternating order
            run, _ = system.run()
            runs[system.name].append(run)
            log(f"{system.name}: {run['tokens_per_s']:.0f} output tok/s")
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["engine"], runs["hf_cb"])]
    return {"workload": et.describe_workload(requests, et_args.length_scale),
            "systems": {s.name: {**et.summarize_runs(runs[s.name]), **s.describe()} for s in systems},
            "engine_vs_hf_cb_per_repeat": ratios, "engine_vs_hf_cb": et.median(ratios)}


def batch1(args: argparse.Namespace, torch: Any, vocab_size: int) -> dict[str, Any]:
    """A lone request's decode steps, CUDA graphs on and off in alternating runs, against the HBM bound."""
    import random

    from engine import SamplingParams

    llm = engine(args, args.dtype, max_num_seqs=8, max_num_batched_tokens=512, kv_cache_bytes=1 << 30)
    runner = llm.engine.runner
    weight_bytes = llm.engine.model.weight_bytes()
    rng = random.Random(1)
    n = args.batch1_tokens + 1
    steps: dict[bool, list[float]] = {True: [], False: []}
    graphs_possible = runner.use_cuda_graphs
    for rep in range(args.batch1_repeats + 1):  # the first run of each warms up (compiles, captures)
        for graphs in ((True, False) if graphs_possible else (False,)):
            runner.use_cuda_graphs = graphs
            prompt = [rng.randrange(et.FIRST_PLAIN_TOKEN, vocab_size) for _ in range(128)]
            last = llm.step_records()[-1].step if llm.step_records() else -1
            llm.generate([prompt], SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True))
            if rep:
                steps[graphs] += [r.total_s for r in llm.step_records(last)
                                  if r.num_prefill_tokens == 0 and r.num_decode_tokens == 1]
    runner.use_cuda_graphs = graphs_possible
    bandwidth = measure_copy_bandwidth(torch, args.device, args.copy_gib)
    bound = weight_bytes / bandwidth["bytes_per_s"]
    best = min((et.median(v) for v in steps.values() if v), default=float("nan"))
    return {"weight_bytes": weight_bytes, "bandwidth": bandwidth, "bound_s": bound,
            "median_step_s_cuda_graphs": et.median(steps[True]) if steps[True] else None,
            "median_step_s_no_graphs": et.median(steps[False]), "steps_per_variant": {str(k): len(v) for k, v in
                                                                                     steps.items()},
            "step_vs_bound": best / bound, "cuda_graphs_speedup": (et.median(steps[False]) / et.median(steps[True])
                                                                   if steps[True] else None)}


def environment(torch: Any, device: str) -> dict[str, Any]:
    import transformers
    import triton

    env = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "cpu_count": os.cpu_count()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        env.update({"gpu": torch.cuda.get_device_name(device), "gpu_memory_bytes": props.total_memory,
                    "sm_count": props.multi_processor_count, "cuda": torch.version.cuda})
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from engine.model_loader import resolve_model_dir

    started = time.perf_counter()
    model_dir = resolve_model_dir(args.model)
    vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    report: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                              "env": environment(torch, args.device), "targets": TARGETS}
    sections = (("greedy", lambda: greedy_check(args, torch, model_dir)),
                ("throughput", lambda: throughput(args, torch, model_dir, vocab_size)),
                ("batch1", lambda: batch1(args, torch, vocab_size)))
    for name, section in sections:
        if name in args.skip:
            continue
        log(f"{name}: start ({time.perf_counter() - started:.0f} s in)")
        section_start = time.perf_counter()
        try:
            report[name] = section()
        except Exception as error:  # one failing part still leaves the others' figures in the JSON
            report[name] = {"error": f"{type(error).__name__}: {error}"}
            log(f"{name}: FAILED {type(error).__name__}: {error}")
        report[name]["section_wall_s"] = time.perf_counter() - section_start
    report["wall_s"] = time.perf_counter() - started
    report["meets_targets"] = {
        "greedy_fp32_identical": report.get("greedy", {}).get("float32", {}).get("identical"),
        "engine_vs_hf_cb": (report.get("throughput", {}).get("engine_vs_hf_cb", 0) >= TARGETS["engine_vs_hf_cb"]
                            if "engine_vs_hf_cb" in report.get("throughput", {}) else None),
        "batch1_step_vs_bound": (report["batch1"]["step_vs_bound"] <= TARGETS["batch1_step_vs_bound"]
                                 if "step_vs_bound" in report.get("batch1", {}) else None)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"env": report["env"], "meets_targets": report["meets_targets"], "wall_s": report["wall_s"],
                      "engine_vs_hf_cb": report.get("throughput", {}).get("engine_vs_hf_cb"),
                      "batch1_step_vs_bound": report.get("batch1", {}).get("step_vs_bound")}, indent=1))
    log(f"wrote {args.out}")
    return 0 if all(v is not False for v in report["meets_targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
