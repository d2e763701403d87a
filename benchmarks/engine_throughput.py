#!/usr/bin/env python
"""Output tokens/s of slotune's engine against transformers, and its batch-1 decode step against the memory bound.

One process loads and warms up every system, then times them one after another on the same model (`--dtype`:
the engine's default `auto` choice unless given, transformers in the same dtype; CPU, `--threads` threads); with `--repeats N` every repeat runs each system once, in a rotating order, so that load from
elsewhere on the machine falls on all of them alike, and medians are reported:

  (a) slotune's engine: `LLM(...).generate` over the whole workload (continuous batching);
  (b) transformers static batching: `model.generate` on left-padded batches of `--static-batch-size` requests taken
      in arrival order; every batch runs until its longest request is done (`min_new_tokens = max_new_tokens =` the
      batch's longest output), and only the tokens each request asked for count as output;
  (c) transformers' own continuous batching: a `ContinuousBatchingManager` (`model.init_continuous_batching`) with
      the "sdpa" paged-attention implementation (the one that runs on CPU), given the engine's limits (requests per
      batch, tokens per batch, KV memory), each request with its own `max_new_tokens` and EOS disabled;
  (d) the engine's batch-1 decode step (median `total_s` of the decode steps of a lone request) against the
      memory-bandwidth bound: weight bytes one forward pass reads / read bandwidth measured in this run
      (best of several `torch.sum` passes over a ~1 GiB fp32 tensor, on the same threads).

The workload: `--num-requests` requests (seeded), short / medium / long in 6:3:1 (exact counts, shuffled), prompts of
random token ids of exact length, outputs of exact length (EOS ignored), so every system produces the same tokens
count. Lengths (prompt / output, uniform, inclusive): short 16-64 / 16-64, medium 128-256 / 64-128,
long 512-1024 / 128-256. `--quick` shrinks the workload (16 requests, lengths x 1/4) for a smoke test.

    python benchmarks/engine_throughput.py --out results/engine_throughput.json
    python benchmarks/engine_throughput.py --quick --out /tmp/quick.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from engine.cpu_info import cpu_name

# Lengths per class: (prompt_min, prompt_max, output_min, output_max), before `--length-scale`.
CLASSES: dict[str, tuple[int, int, int, int]] = {
    "short": (16, 64, 16, 64),
    "medium": (128, 256, 64, 128),
    "long": (512, 1024, 128, 256),
}
MIX = {"short": 6, "medium": 3, "long": 1}
# Random prompt tokens are drawn above the tokenizer's special tokens (SmolLM2: ids 0-16).
FIRST_PLAIN_TOKEN = 100
TARGETS = {"engine_vs_static": 3.0, "engine_vs_hf_cb": 2.0, "batch1_step_vs_bound": 1.3}
# A batch-1 run counts as measured at one bandwidth when the probes before and after it differ by at most this
# share (some VMs switch between two memory bandwidths from one minute to the next).
BANDWIDTH_STABLE = 0.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a Hugging Face model folder; default: the engine's default model")
    p.add_argument("--threads", type=int, default=2, help="torch threads (also OMP/MKL threads); default 2")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights, activations and KV cache of every system: the engine's dtype (auto: its default "
                        "choice) and transformers' (the same)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--length-scale", type=float, default=1.0, help="multiplies every length bound")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke test: 16 requests, lengths x 1/4")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per system (medians are reported)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine max_num_seqs = HF max_requests_per_batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="engine max_num_batched_tokens = HF max_batch_tokens")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="KV memory of both continuous batchers")
    p.add_argument("--block-size", type=int, default=16, help="engine block_size")
    p.add_argument("--static-batch-size", type=int, default=64,
                   help="requests per transformers static batch (64: the whole workload in one padded batch)")
    p.add_argument("--hf-page-size", type=int, default=None,
                   help="page size of transformers' paged cache; default: transformers' own default (256)")
    p.add_argument("--batch1-prompt", type=int, default=128, help="prompt length of the batch-1 decode run")
    p.add_argument("--batch1-tokens", type=int, default=128, help="decode steps of each batch-1 run")
    p.add_argument("--batch1-repeats", type=int, default=6)
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the bandwidth-test tensor")
    p.add_argument("--bandwidth-passes", type=int, default=10)
    p.add_argument("--device", default="cpu", help="torch device of every system (benchmarks/gpu_suite.py: cuda)")
    p.add_argument("--skip", nargs="*", default=[], choices=["engine", "static", "hf_cb", "batch1"],
                   help="systems to leave out")
    p.add_argument("--out", type=Path, default=Path("engine_throughput.json"), help="where the JSON result goes")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = min(args.num_requests, 16)
        args.length_scale = 0.25 if args.length_scale == 1.0 else args.length_scale
        args.batch1_tokens = min(args.batch1_tokens, 48)
        args.batch1_repeats = min(args.batch1_repeats, 2)
        args.bandwidth_passes = min(args.bandwidth_passes, 5)
    return args


# Workload --------------------------------------------------------------------------------------------------------
@dataclass
class Request:
    index: int
    kind: str
    prompt: list[int]
    output_len: int


def class_counts(n: int) -> dict[str, int]:
    """Exact 6:3:1 counts for n requests (largest remainder)."""
    total = sum(MIX.values())
    raw = {k: n * w / total for k, w in MIX.items()}
    counts = {k: int(v) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: raw[k] - counts[k], reverse=True)[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def class_bounds(scale: float) -> dict[str, tuple[int, int, int, int]]:
    def scaled(bounds: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        a, b, c, d = (max(1, round(v * scale)) for v in bounds)
        return a, b, c, d
    return {k: scaled(b) for k, b in CLASSES.items()}


def make_workload(n: int, seed: int, scale: float, vocab_size: int) -> list[Request]:
    rng = random.Random(seed)
    kinds = [k for k, c in class_counts(n).items() for _ in range(c)]
    rng.shuffle(kinds)
    bounds = class_bounds(scale)
    requests = []
    for i, kind in enumerate(kinds):
        p_lo, p_hi, o_lo, o_hi = bounds[kind]
        prompt_len = rng.randint(p_lo, p_hi)
        requests.append(Request(i, kind, [rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(prompt_len)],
                                rng.randint(o_lo, o_hi)))
    return requests


def warmup_workload(vocab_size: int, seed: int) -> list[Request]:
    """A few requests of every class (other prompts than the measured ones, so no prefix cache hits carry over)."""
    return make_workload(6, seed + 10_000, 0.25, vocab_size)


def describe_workload(requests: list[Request], scale: float) -> dict[str, Any]:
    by_kind = {}
    for kind in CLASSES:
        rs = [r for r in requests if r.kind == kind]
        by_kind[kind] = {
            "count": len(rs),
            "bounds_prompt": list(class_bounds(scale)[kind][:2]),
            "bounds_output": list(class_bounds(scale)[kind][2:]),
            "prompt_tokens": sum(len(r.prompt) for r in rs),
            "output_tokens": sum(r.output_len for r in rs),
        }
    return {
        "num_requests": len(requests),
        "mix": MIX,
        "length_scale": scale,
        "classes": by_kind,
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "requests": [{"kind": r.kind, "prompt_len": len(r.prompt), "output_len": r.output_len} for r in requests],
    }


# Measurements ----------------------------------------------------------------------------------------------------
def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def measure_bandwidth(torch: Any, gib: float, passes: int) -> dict[str, Any]:
    """Read bandwidth (bytes/s): best of `passes` torch.sum over a `gib` GiB fp32 tensor."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    nbytes = x.numel() * 4
    times = []
    for _ in range(passes + 1):  # the first pass only warms up
        start = time.perf_counter()
        torch.sum(x)
        times.append(time.perf_counter() - start)
    times = times[1:]
    del x
    best = min(times)
    return {"tensor_bytes": nbytes, "passes": passes, "best_s": best, "median_s": median(times),
            "bytes_per_s": nbytes / best, "gb_per_s": nbytes / best / 1e9,
            "median_gb_per_s": nbytes / median(times) / 1e9}


def threads_seen_by_new_thread(torch: Any) -> int:
    """torch's thread count inside a fresh Python thread (transformers' batching loop runs in one)."""
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


class System(Protocol):
    """What the drivers below have in common: a name, a warm-up, one timed run of the workload, a description."""

    name: str

    def warm_up(self, warm: list[Request]) -> None: ...

    def run(self) -> tuple[dict[str, Any], list[list[int]]]: ...

    def describe(self) -> dict[str, Any]: ...


class EngineSystem:
    """slotune's engine: `LLM(...).generate` over the whole workload."""

    name = "engine"

    def __init__(self, args: argparse.Namespace, requests: list[Request], dtype: str = "auto") -> None:
        from engine import LLM

        self.args = args
        self.requests = requests
        self.llm = LLM(model=args.model, dtype=dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                       kv_cache_bytes=args.kv_cache_bytes)

    @staticmethod
    def params(r: Request) -> Any:
        from engine import SamplingParams

        return SamplingParams(max_tokens=r.output_len, min_tokens=r.output_len, temperature=0.0, ignore_eos=True)

    def clear_prefix_cache(self) -> None:
        # Forget cached blocks, so a repeat does not reuse the previous run's prompt blocks.
        self.llm.update_config(enable_prefix_caching=False)
        self.llm.update_config(enable_prefix_caching=True)

    def warm_up(self, warm: list[Request]) -> None:
        self.llm.generate([r.prompt for r in warm], [self.params(r) for r in warm])

    def run(self) -> tuple[dict[str, Any], list[list[int]]]:
        llm, requests = self.llm, self.requests
        self.clear_prefix_cache()
        last = llm.step_records()[-1].step if llm.step_records() else -1
        start = time.perf_counter()
        outs = llm.generate([r.prompt for r in requests], [self.params(r) for r in requests])
        wall = time.perf_counter() - start
        got = [len(o.token_ids) for o in outs]
        want = [r.output_len for r in requests]
        if got != want:
            raise RuntimeError(f"engine produced {sum(got)} tokens, expected {sum(want)}")
        records = llm.step_records(last)
        decode_steps = [rec for rec in records if rec.num_prefill_tokens == 0]
        run = {
            "wall_s": wall, "output_tokens": sum(got), "tokens_per_s": sum(got) / wall,
            "steps": len(records), "decode_only_steps": len(decode_steps),
            "mean_tokens_per_step": statistics.fmean(rec.num_tokens for rec in records) if records else 0,
            "max_running": max((rec.num_running for rec in records), default=0),
            "preemptions": sum(rec.num_preemptions for rec in records),
            "prefix_cache_hit_tokens": sum(rec.prefix_cache_hit_tokens for rec in records),
            "sum_forward_s": sum(rec.forward_s for rec in records),
            "sum_sample_s": sum(rec.sample_s for rec in records),
            "sum_schedule_s": sum(rec.schedule_s for rec in records),
            "sum_total_s": sum(rec.total_s for rec in records),
        }
        return run, [list(o.token_ids) for o in outs]

    def describe(self) -> dict[str, Any]:
        choice = self.llm.engine.dtype_choice
        return {"config": dict(self.llm.config.knobs()), "weight_bytes": self.llm.engine.model.weight_bytes(),
                "dtype": choice.name, "dtype_reason": choice.reason}


def run_batch1(args: argparse.Namespace, llm: Any, vocab_size: int, torch: Any) -> dict[str, Any]:
    """Decode steps of a lone request: median total_s (and forward_s) over all runs. Each run sits between two
    bandwidth measurements, so that every run has a bound taken under the same conditions (`pair_ratios`; runs
    whose two probes differ by more than BANDWIDTH_STABLE are flagged: the machine's bandwidth moved during them)."""
    from engine import SamplingParams
    from loadtest.summary import percentile

    rng = random.Random(args.seed + 20_000)
    weight_bytes = llm.engine.model.weight_bytes()
    steps_total: list[float] = []
    steps_forward: list[float] = []
    variant_totals: dict[str, list[float]] = {"python_loop": [], "aten_only": []}
    per_run = []
    bandwidth = []
    n = args.batch1_tokens + 1  # the first token comes from the prefill step
    for rep in range(args.batch1_repeats + 1):  # the first run warms up
        llm.update_config(enable_prefix_caching=False)
        llm.update_config(enable_prefix_caching=True)
        prompt = [rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(args.batch1_prompt)]
        before = measure_bandwidth(torch, args.bandwidth_gib, args.bandwidth_passes) if rep else None
        last = llm.step_records()[-1].step if llm.step_records() else -1
        llm.generate([prompt], SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True))
        decode = [r for r in llm.step_records(last)
                  if r.num_prefill_tokens == 0 and r.num_decode_tokens == 1]
        if before is None:
            continue
        after = measure_bandwidth(torch, args.bandwidth_gib, args.bandwidth_passes)
        model = llm.engine.model
        if model.kernels is not None:
            # The same run without each of the C++ kernels (engine/fused_layers.py), alternating: what each saves.
            # torch's ops alone only in fp32: a bf16 model's weights (fp32 activations beside them, the AMX tiles'
            # layout) are the kernels' own forms.
            variants = [("python_loop", model.kernels, False)]
            if model.dtype == torch.float32:
                variants.append(("aten_only", None, False))
            for variant, kernels, fused_loop in variants:
                saved = model.kernels, model.fused_loop
                model.kernels, model.fused_loop = kernels, fused_loop
                try:
                    last_variant = llm.step_records()[-1].step
                    llm.generate([prompt], SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0,
                                                          ignore_eos=True))
                finally:
                    model.kernels, model.fused_loop = saved
                variant_totals[variant] += [r.total_s for r in llm.step_records(last_variant)
                                            if r.num_prefill_tokens == 0 and r.num_decode_tokens == 1]
        totals = [r.total_s for r in decode]
        steps_total += totals
        steps_forward += [r.forward_s for r in decode]
        bandwidth += [before, after]
        around = (before["bytes_per_s"] + after["bytes_per_s"]) / 2
        per_run.append({"median_total_s": median(totals), "median_forward_s": median([r.forward_s for r in decode]),
                        "bandwidth_gb_per_s": around / 1e9, "bandwidth_before_after_gb_per_s":
                            [before["gb_per_s"], after["gb_per_s"]],
                        "stable": abs(before["bytes_per_s"] - after["bytes_per_s"]) <= BANDWIDTH_STABLE * around,
                        "bound_s": weight_bytes / around, "ratio": median(totals) / (weight_bytes / around)})
    stable = [r for r in per_run if r["stable"]]
    return {
        "prompt_tokens": args.batch1_prompt, "decode_steps_per_run": args.batch1_tokens,
        "runs": args.batch1_repeats, "median_total_s": median(steps_total), "median_forward_s": median(steps_forward),
        "p10_total_s": percentile(steps_total, 10), "p90_total_s": percentile(steps_total, 90),
        "best_run_median_total_s": min(r["median_total_s"] for r in per_run),
        "pair_ratios": [r["ratio"] for r in per_run], "stable_pair_ratios": [r["ratio"] for r in stable],
        "per_run": per_run, "bandwidth": bandwidth, "weight_bytes": weight_bytes,
        # the Python layer loop with the C++ kernels; no C++ kernels at all (the Python loop on torch's ops)
        **{f"{variant}_median_total_s": median(totals) if totals else None
           for variant, totals in variant_totals.items()},
    }


def load_hf_model(args: argparse.Namespace, model_dir: Path, torch: Any) -> Any:
    from transformers import AutoModelForCausalLM

    from engine.precision import choose_dtype

    dtype = choose_dtype(args.dtype, args.device).dtype  # the engine's: both systems run the same dtype
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(args.device).eval()


class StaticSystem:
    """transformers static batching: `generate` on left-padded batches of B requests in arrival order; each batch
    runs until its longest request is done."""

    name = "static"

    def __init__(self, args: argparse.Namespace, model: Any, requests: list[Request], pad_id: int, torch: Any) -> None:
        self.args, self.model, self.requests, self.pad_id, self.torch = args, model, requests, pad_id, torch

    def _batch(self, batch: list[Request]) -> tuple[list[list[int]], int]:
        torch, pad_id = self.torch, self.pad_id
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding
            ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt):] = 1
        steps = max(r.output_len for r in batch)  # the batch waits for its longest request
        with torch.inference_mode():
            ids, mask = ids.to(self.model.device), mask.to(self.model.device)
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                                      do_sample=False, pad_token_id=pad_id)
        new = out[:, width:]
        if new.shape[1] != steps:
            raise RuntimeError(f"static batch produced {new.shape[1]} tokens per row, expected {steps}")
        return [new[row, : r.output_len].tolist() for row, r in enumerate(batch)], steps * len(batch)

    def warm_up(self, warm: list[Request]) -> None:
        self._batch(warm[: self.args.static_batch_size])

    def run(self) -> tuple[dict[str, Any], list[list[int]]]:
        B, requests = self.args.static_batch_size, self.requests
        outputs: list[list[int]] = []
        generated = 0
        start = time.perf_counter()
        for i in range(0, len(requests), B):
            outs, gen = self._batch(requests[i : i + B])
            outputs += outs
            generated += gen
        wall = time.perf_counter() - start
        useful = sum(r.output_len for r in requests)
        return ({"wall_s": wall, "output_tokens": useful, "tokens_per_s": useful / wall,
                 "generated_tokens_incl_padding": generated, "batches": math.ceil(len(requests) / B)}, outputs)

    def describe(self) -> dict[str, Any]:
        return {"config": {"batch_size": self.args.static_batch_size, "order": "arrival", "padding": "left",
                           "attn_implementation": "sdpa", "api": "model.generate(input_ids, attention_mask, "
                           "max_new_tokens=L, min_new_tokens=L, do_sample=False), L = longest output of the batch"}}


class HFContinuousBatchingSystem:
    """transformers' continuous batching: a ContinuousBatchingManager with the engine's limits."""

    name = "hf_cb"

    def __init__(self, args: argparse.Namespace, model: Any, requests: list[Request], torch: Any) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        self.args, self.model, self.requests, self.torch = args, model, requests, torch
        text_cfg = model.config.get_text_config()
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
        element = torch.tensor([], dtype=model.dtype).element_size()
        kv_bytes_per_token = 2 * text_cfg.num_hidden_layers * text_cfg.num_key_value_heads * head_dim * element
        cb_kwargs: dict[str, Any] = {}
        if args.hf_page_size is not None:
            cb_kwargs["page_size"] = args.hf_page_size
        page_size = cb_kwargs.get("page_size", ContinuousBatchingConfig.page_size)
        # The same KV memory as the engine's pool (`num_blocks` is a capacity target in pages of `page_size` tokens).
        num_blocks = max(1, args.kv_cache_bytes // (kv_bytes_per_token * page_size))
        self.gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in requests),
                                           eos_token_id=-1, pad_token_id=model.generation_config.pad_token_id)
        self.cb_config = ContinuousBatchingConfig(
            num_blocks=num_blocks, max_batch_tokens=args.max_num_batched_tokens,
            max_requests_per_batch=args.max_num_seqs, default_compile_level=0,
            # on a GPU transformers decides (None: its own rule); on the CPU there are none
            use_cuda_graph=None if args.device.startswith("cuda") else False, **cb_kwargs)
        self.hints = WorkloadHints(max_prompt_length=max(len(r.prompt) for r in requests),
                                   max_generated_length=max(r.output_len for r in requests),
                                   num_requests=len(requests))
        self.warm: list[Request] = []
        self.resolved: Any = None
        self.runs = 0

    @staticmethod
    def _submit_and_wait(manager: Any, reqs: list[Request], tag: str) -> list[list[int]]:
        ids = {}
        for r in reqs:
            rid = f"{tag}-{r.index}"
            manager.add_request(r.prompt, request_id=rid, max_new_tokens=r.output_len, eos_token_id=-1)
            ids[rid] = r
        results: dict[str, list[int]] = {}
        while len(results) < len(ids):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped before finishing")
                continue
            if res.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed a request: {res.error}")
            if res.is_finished() and res.request_id in ids:
                results[res.request_id] = list(res.generated_tokens)
        return [results[rid] for rid in ids]

    def warm_up(self, warm: list[Request]) -> None:
        self.warm = warm  # warmed up inside every run, on that run's fresh manager

    def run(self) -> tuple[dict[str, Any], list[list[int]]]:
        torch = self.torch
        tag = f"run{self.runs}"
        self.runs += 1
        # A fresh manager (and paged cache) per run, so no prefix blocks carry over; warmed up before timing.
        manager = self.model.init_continuous_batching(generation_config=self.gen_config,
                                                      continuous_batching_config=self.cb_config,
                                                      workload_hints=self.hints)
        with torch.inference_mode():
            manager.start()
            try:
                self._submit_and_wait(manager, self.warm, f"{tag}-warm")
                start = time.perf_counter()
                outputs = self._submit_and_wait(manager, self.requests, tag)
                wall = time.perf_counter() - start
            finally:
                manager.stop(block=True, timeout=60)
                self.resolved = manager.continuous_batching_config
                manager.destroy()
        got = [len(o) for o in outputs]
        want = [r.output_len for r in self.requests]
        if got != want:
            raise RuntimeError(f"transformers CB produced {sum(got)} tokens, expected {sum(want)}")
        return {"wall_s": wall, "output_tokens": sum(got), "tokens_per_s": sum(got) / wall}, outputs

    def describe(self) -> dict[str, Any]:
        r = self.resolved
        if r is None:
            return {}
        return {"config": {
            "api": "model.init_continuous_batching(generation_config, continuous_batching_config, workload_hints) "
                   "-> ContinuousBatchingManager; start(); add_request(prompt_ids, max_new_tokens=n, "
                   "eos_token_id=-1) per request; get_result() until all finished; stop(); destroy()",
            "attn_implementation": self.model.config._attn_implementation,
            "page_size": r.page_size, "num_blocks": r.num_blocks, "max_batch_tokens": r.max_batch_tokens,
            "max_requests_per_batch": r.max_requests_per_batch, "allow_block_sharing": r.allow_block_sharing,
            "use_cuda_graph": list(r.use_cuda_graph), "use_async_batching": r.use_async_batching,
            "scheduler_type": r.scheduler_type, "compile": r.varlen_compile_config is not None,
        }}


def hf_batch1_step(model: Any, prompt_len: int, tokens: int, vocab_size: int, seed: int, pad_id: int,
                   torch: Any) -> float:
    """transformers' own batch-1 decode step, for reference: (t(1 + tokens) - t(1)) / tokens, best of 2."""
    rng = random.Random(seed)
    ids = torch.tensor([[rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(prompt_len)]])

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=pad_id)
        return time.perf_counter() - start

    timed(4)
    best = min((timed(1 + tokens) - timed(1)) / tokens for _ in range(2))
    return best


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"runs": runs, "tokens_per_s": median([r["tokens_per_s"] for r in runs]),
            "wall_s": median([r["wall_s"] for r in runs]), "output_tokens": runs[0]["output_tokens"]}


def agreement(a: list[list[int]] | None, b: list[list[int]] | None) -> float | None:
    """Share of requests whose greedy outputs are identical (informational: batching changes fp32 rounding)."""
    if not a or not b:
        return None
    return sum(x == y for x, y in zip(a, b)) / len(a)


# Report ----------------------------------------------------------------------------------------------------------
def fmt(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown(report: dict[str, Any]) -> str:
    s = report["systems"]
    r = report["ratios"]
    w = report["workload"]
    lines = [
        f"Workload: {w['num_requests']} requests (short/medium/long "
        + "/".join(str(w["classes"][k]["count"]) for k in CLASSES)
        + f"), {w['prompt_tokens']} prompt tokens, {w['output_tokens']} output tokens; "
        f"{report['env']['threads']} threads, {s.get('engine', {}).get('dtype_reason', report['args']['dtype'])}, "
        f"CPU {report['env']['cpu']}, repeats={report['args']['repeats']}",
        "",
        "| system | output tok/s (median) | wall s (median) | tok/s per repeat | engine / system "
        "| per repeat | target |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    names = [("engine", "slotune engine (continuous batching)", None, None),
             ("static", f"transformers static batching (B={report['args']['static_batch_size']})",
              "engine_vs_static", TARGETS["engine_vs_static"]),
             ("hf_cb", "transformers continuous batching", "engine_vs_hf_cb", TARGETS["engine_vs_hf_cb"])]
    for key, label, ratio, target in names:
        if key not in s:
            continue
        per_repeat = ", ".join(fmt(run["tokens_per_s"]) for run in s[key]["runs"])
        ratio_runs = ", ".join(fmt(x, 2) for x in r.get(f"{ratio}_per_repeat", [])) if ratio else ""
        lines.append(f"| {label} | {fmt(s[key]['tokens_per_s'])} | {fmt(s[key]['wall_s'], 2)} | {per_repeat} | "
                     f"{fmt(r.get(ratio), 2) + 'x' if ratio and r.get(ratio) else '—'} | {ratio_runs or '—'} | "
                     f"{'>= ' + fmt(target, 1) + 'x' if target else '—'} |")
    b = report.get("batch1")
    if b:
        stable = [run for run in b["per_run"] if run["stable"]]
        lines += [
            "",
            "| batch-1 decode | value |",
            "|---|---:|",
            f"| read bandwidth (best torch.sum, {report['env']['threads']} threads) | "
            f"{fmt(b['bandwidth_gb_per_s'], 2)} GB/s |",
            f"| weight bytes per forward | {b['weight_bytes'] / 1e6:.1f} MB |",
            f"| memory-bandwidth bound | {fmt(b['bound_s'] * 1e3, 2)} ms |",
            f"| engine batch-1 step (median total_s) | {fmt(b['median_total_s'] * 1e3, 2)} ms |",
            f"| engine batch-1 forward (median forward_s) | {fmt(b['median_forward_s'] * 1e3, 2)} ms |",
            f"| same, Python layer loop instead of the fused C++ loop (alternating runs) | "
            f"{fmt((b.get('python_loop_median_total_s') or math.nan) * 1e3, 2)} ms |",
            f"| same, no C++ kernels (Python layer loop on torch's ops; alternating runs) | "
            f"{fmt((b.get('aten_only_median_total_s') or math.nan) * 1e3, 2)} ms |",
            f"| transformers batch-1 step (reference) | {fmt((b.get('hf_step_s') or float('nan')) * 1e3, 2)} ms |",
            f"| step / bound at the best bandwidth (all runs) | {fmt(r.get('batch1_step_vs_best_bound'), 2)}x |",
            f"| best run's median step / bound at the best bandwidth | "
            f"{fmt(r.get('batch1_best_run_vs_best_bound'), 2)}x |",
            f"| **step / bound, each run against the bandwidth around it** (median of {len(stable)} runs whose "
            f"bandwidth held, of {len(b['per_run'])}) | **{fmt(r.get('batch1_step_vs_bound'), 2)}x** "
            f"(target <= {TARGETS['batch1_step_vs_bound']}x) |",
        ]
        lines += ["", "| batch-1 run | GB/s before, after | bound ms | step ms | step / bound |",
                  "|---:|---:|---:|---:|---:|"]
        for i, run in enumerate(b["per_run"], 1):
            before, after = run["bandwidth_before_after_gb_per_s"]
            lines.append(f"| {i}{'' if run['stable'] else ' (bandwidth moved)'} | {fmt(before)}, {fmt(after)} | "
                         f"{fmt(run['bound_s'] * 1e3, 2)} | {fmt(run['median_total_s'] * 1e3, 2)} | "
                         f"{fmt(run['ratio'], 2)}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Before torch loads: threads that torch starts later (transformers' batching thread) must see the same count.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from engine.model_loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    pad_id = config.get("pad_token_id")
    pad_id = int(pad_id if pad_id is not None else config.get("eos_token_id", 0))
    requests = make_workload(args.num_requests, args.seed, args.length_scale, vocab_size)
    warm = warmup_workload(vocab_size, args.seed)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def loadavg() -> list[float] | None:
        return list(os.getloadavg()) if hasattr(os, "getloadavg") else None

    env = {
        "threads": args.threads, "torch_threads": torch.get_num_threads(),
        "torch_threads_in_new_thread": threads_seen_by_new_thread(torch),
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__, "model_dir": str(model_dir),
        "loadavg_start": loadavg(), "cpu": cpu_name(),
    }
    report: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                              "env": env, "workload": describe_workload(requests, args.length_scale),
                              "systems": {}, "ratios": {}, "targets": TARGETS}

    log("measuring read bandwidth")
    bandwidth = [measure_bandwidth(torch, args.bandwidth_gib, args.bandwidth_passes)]

    # Load and warm up every system, then time them in turns: each repeat runs every system once (the order
    # rotates), so that load from elsewhere on the machine falls on all of them alike.
    systems: list[System] = []
    engine_system = None
    if "engine" not in args.skip or "batch1" not in args.skip:
        log("engine: loading")
        engine_system = EngineSystem(args, requests, dtype=args.dtype)
        if "engine" not in args.skip:
            systems.append(engine_system)
    model = None
    if "static" not in args.skip or "hf_cb" not in args.skip or "batch1" not in args.skip:
        log("transformers: loading")
        model = load_hf_model(args, model_dir, torch)
        if "static" not in args.skip:
            systems.append(StaticSystem(args, model, requests, pad_id, torch))
        if "hf_cb" not in args.skip:
            systems.append(HFContinuousBatchingSystem(args, model, requests, torch))
    for system in systems:
        log(f"{system.name}: warm-up")
        system.warm_up(warm)

    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
    outputs: dict[str, list[list[int]]] = {}
    for rep in range(args.repeats):
        order = systems[rep % len(systems):] + systems[: rep % len(systems)] if systems else []
        for system in order:
            log(f"{system.name}: timed run {rep + 1}/{args.repeats}")
            before = loadavg()
            run, outs = system.run()
            run["loadavg_before"] = before
            runs[system.name].append(run)
            outputs[system.name] = outs
            log(f"{system.name}: {run['tokens_per_s']:.1f} output tok/s ({run['wall_s']:.1f} s)")
    for system in systems:
        report["systems"][system.name] = {**summarize_runs(runs[system.name]), **system.describe()}

    if "batch1" not in args.skip and engine_system is not None:
        log("engine batch-1 decode steps")
        batch1 = run_batch1(args, engine_system.llm, vocab_size, torch)
        bandwidth += batch1.pop("bandwidth")
        best_bw = max(b["bytes_per_s"] for b in bandwidth)
        batch1.update({"bandwidth_gb_per_s": best_bw / 1e9, "bound_s": batch1["weight_bytes"] / best_bw})
        if model is not None:
            log("transformers batch-1 reference step")
            batch1["hf_step_s"] = hf_batch1_step(model, args.batch1_prompt, min(args.batch1_tokens, 32), vocab_size,
                                                 args.seed, pad_id, torch)
        report["batch1"] = batch1
        # The target's figure: each run against the bandwidth measured around it, median over the runs whose
        # bandwidth held (all runs if none did). The whole run's median step against its best bandwidth, the
        # stricter figure, mixes runs at different bandwidths where the machine's bandwidth moves.
        report["ratios"]["batch1_step_vs_bound"] = median(batch1["stable_pair_ratios"] or batch1["pair_ratios"])
        report["ratios"]["batch1_step_vs_best_bound"] = batch1["median_total_s"] / batch1["bound_s"]
        report["ratios"]["batch1_forward_vs_best_bound"] = batch1["median_forward_s"] / batch1["bound_s"]
        report["ratios"]["batch1_best_run_vs_best_bound"] = batch1["best_run_median_total_s"] / batch1["bound_s"]
    report["bandwidth"] = bandwidth

    done = report["systems"]
    if "engine" in done:
        for key, ratio in (("static", "engine_vs_static"), ("hf_cb", "engine_vs_hf_cb")):
            if key in done:
                report["ratios"][ratio] = done["engine"]["tokens_per_s"] / done[key]["tokens_per_s"]
                # Per repeat too: the systems of one repeat ran back to back, under similar load.
                report["ratios"][ratio + "_per_repeat"] = [
                    a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["engine"], runs[key])]
    report["meets_targets"] = {
        k: (v >= TARGETS[k] if k.startswith("engine") else v <= TARGETS[k])
        for k, v in report["ratios"].items() if k in TARGETS
    }
    report["identical_outputs_share"] = {
        "engine_vs_static": agreement(outputs.get("engine"), outputs.get("static")),
        "engine_vs_hf_cb": agreement(outputs.get("engine"), outputs.get("hf_cb")),
    }
    env["loadavg_end"] = loadavg()

    table = markdown(report)
    report["markdown"] = table
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
