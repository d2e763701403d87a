"""``slotune calibrate``: profile the real engine over HTTP and fit the simulator's step-time model.

    slotune calibrate --out profile.json                                 # starts the default engine itself
    slotune calibrate --engine-url http://127.0.0.1:8000 --admin-token T --out profile.json

The profiling load covers the shapes a search produces: several configs (block sizes 8/16/32, step budgets and
chunks from small to large, batch limits from 1 to 16) are applied in turn with PATCH /admin/config, and each gets
a mixed-length open-loop load whose rate ramps up, so batches grow from one sequence to full. A few lone requests
first measure the HTTP path's latency. The engine's step records (GET /debug/steps) of every window, tagged with
the config's block size, are fitted (tuner.simulation.step_time_model); the profile is saved with its held-out fit error and
the profiled range of each input. The previous config is restored at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from engine.cpu_info import cpu_name
from loadtest.config import LoadConfig
from loadtest.runner import run_loadtest
from tuner.trials.engine_handle import ConfigRejected, EngineError, EngineHandle, ManagedEngine
from tuner.simulation.profiles import limits_from
from tuner.simulation.step_time_model import ProfileError, StepTimeModel

# (knobs, ramp from, ramp to requests/s): small to large batches, budgets, chunks and blocks.
DEFAULT_PLAN: list[tuple[dict[str, Any], float, float]] = [
    ({"max_num_seqs": 1, "max_num_batched_tokens": 32, "chunk_size": 16, "block_size": 8}, 0.2, 1.5),
    ({"max_num_seqs": 4, "max_num_batched_tokens": 64, "chunk_size": 32, "block_size": 16}, 0.2, 2.0),
    ({"max_num_seqs": 8, "max_num_batched_tokens": 128, "chunk_size": 64, "block_size": 32}, 0.2, 2.5),
    ({"max_num_seqs": 16, "max_num_batched_tokens": 256, "chunk_size": 128, "block_size": 16}, 0.2, 3.0),
    ({"max_num_seqs": 12, "max_num_batched_tokens": 192, "chunk_size": 192, "block_size": 8}, 0.2, 3.0),
    # small chunks under a large budget: several prefill chunks in one step, so their per-chunk cost is measured
    # apart from their tokens (without it, steps of 3-5 chunks were over-predicted by ~20 %)
    ({"max_num_seqs": 16, "max_num_batched_tokens": 128, "chunk_size": 16, "block_size": 16}, 0.5, 4.0),
]
# Mixed lengths a little beyond the default policy's (length scale 0.125), so that searches stay inside the range.
DEFAULT_MIX = "short=8-32:2-12,medium=32-96:8-24,long=96-320:16-40"


@dataclass
class CalibrationPlan:
    configs: list[tuple[dict[str, Any], float, float]] = field(default_factory=lambda: list(DEFAULT_PLAN))
    seconds_per_config: float = 30.0
    mix: str = DEFAULT_MIX
    mix_weights: str = "5:3:2"
    probes: int = 5
    seed: int = 0


def probe_latency(handle: EngineHandle, n: int) -> float:
    """Median of (client TTFT - the engine's step time) over ``n`` lone streamed requests: the HTTP path's
    round trip outside the engine's steps (request in, token out)."""
    overheads = []
    model = handle.model()
    for i in range(n):
        _, last = handle.steps(10**12)
        body = {"prompt": [100 + i + j for j in range(16)], "max_tokens": 2, "ignore_eos": True, "stream": True,
                "temperature": 0.0, **({"model": model} if model else {})}
        start = time.perf_counter()
        first = None
        with httpx.stream("POST", handle.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and first is None and '"text"' in line:
                    first = time.perf_counter() - start
        steps, _ = handle.steps(last)
        if first is not None and steps:
            overheads.append(max(0.0, first - steps[0]["total_s"]))
        time.sleep(0.2)
    return statistics.median(overheads) if overheads else 0.0


def busy_gaps(steps: list[dict[str, Any]]) -> list[float]:
    """Time between a step's end and the next step's start when the engine had work left (it steps again at once)."""
    gaps = []
    for a, b in zip(steps, steps[1:]):
        if b["step"] == a["step"] + 1 and (a["num_running"] or a["num_waiting"] or a["num_preempted"]):
            gaps.append(b["start_time"] - a["start_time"] - a["total_s"])
    return [g for g in gaps if g >= 0]


def calibrate(handle: EngineHandle, plan: CalibrationPlan, workdir: Path,
              log: Callable[[str], None] = lambda s: None, steps_out: Path | None = None) -> StepTimeModel:
    """Run the plan against the engine and fit the model (``steps_out``: also keep the step records as JSONL)."""
    before = handle.get_config()
    steps: list[dict[str, Any]] = []
    try:
        handle.patch_config(plan.configs[0][0])
        latency = probe_latency(handle, plan.probes)
        log(f"HTTP round trip outside the steps: {latency * 1000:.1f} ms")
        for n, (knobs, rate, ramp_to) in enumerate(plan.configs):
            handle.wait_idle(120)
            applied = handle.patch_config(knobs)
            _, last = handle.steps(10**12)
            cfg = LoadConfig(url=handle.url, workload="mixed", mix=plan.mix, mix_weights=plan.mix_weights,
                             arrival="ramp", rate=rate, ramp_to=ramp_to, duration=plan.seconds_per_config,
                             seed=plan.seed + n, drain_timeout=10.0, request_timeout=30.0,
                             out=str(workdir / f"config{n}"))
            log(f"config {n + 1}/{len(plan.configs)}: {knobs}, rate {rate:g} -> {ramp_to:g} req/s for "
                f"{plan.seconds_per_config:g}s")
            run_loadtest(cfg, realtime=True)
            handle.wait_idle(120)
            page = handle.step_page(last)
            window = page.records
            for s in window:
                s["block_size"] = applied["block_size"]
            steps += window
            log(f"  {len(window)} steps" + (f" ({page.dropped} earlier ones were dropped from the engine's step "
                                            "buffer before they were read: raise slotune serve --step-buffer)"
                                            if page.dropped else ""))
    finally:
        try:
            handle.patch_config(before)
        except (EngineError, ConfigRejected):
            pass
    if steps_out is not None:
        steps_out.write_text("".join(json.dumps(s) + "\n" for s in steps))
    gaps = busy_gaps(sorted(steps, key=lambda s: s["step"]))
    gap = statistics.fmean(sorted(gaps)[: max(1, int(len(gaps) * 0.99))]) if gaps else 0.0
    health = handle.health() or {}
    cfg_now = handle.admin_config()
    return StepTimeModel.fit(steps, gap_s=gap, request_latency_s=latency / 2, token_latency_s=latency / 2,
                             meta={"engine": handle.url, "model": handle.model(), "steps": len(steps),
                                   "configs": [c[0] for c in plan.configs], "calibrated_at": time.time(),
                                   "limits": limits_from(cfg_now),
                                   "health": {k: health.get(k) for k in ("model", "dtype", "config_generation")}})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slotune calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where to write the profile (JSON)")
    p.add_argument("--engine-url", default=None, help="a running `slotune serve` (default: start the default "
                   "engine here)")
    p.add_argument("--admin-token", default=None, help="the engine's admin token (with --engine-url)")
    p.add_argument("--seconds-per-config", type=float, default=30.0,
                   help=f"load per profiled config ({len(DEFAULT_PLAN)} configs)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.seconds_per_config <= 0:
        print("slotune calibrate: --seconds-per-config must be > 0", file=sys.stderr)
        return 2
    if args.engine_url and not args.admin_token:
        print("slotune calibrate: --engine-url needs --admin-token (the profile applies configs live)",
              file=sys.stderr)
        return 2
    plan = CalibrationPlan(seconds_per_config=args.seconds_per_config, seed=args.seed)

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    managed = None
    try:
        if args.engine_url:
            handle = EngineHandle(args.engine_url, args.admin_token)
            if not handle.alive():
                print(f"slotune calibrate: --engine-url: {args.engine_url} does not answer /health", file=sys.stderr)
                return 2
        else:
            log("starting the default engine (slotune serve) ...")
            managed = ManagedEngine()
            handle = managed.start()
        with tempfile.TemporaryDirectory(prefix="slotune-calibrate-") as tmp:
            model = calibrate(handle, plan, Path(tmp), log, Path(args.out).with_suffix(".steps.jsonl"))
    except (EngineError, ConfigRejected, ProfileError) as error:
        print(f"slotune calibrate: {error}", file=sys.stderr)
        return 1
    finally:
        if managed is not None:
            managed.stop()
    if managed is not None:  # the engine ran here: file the profile under this CPU (a remote engine's is unknown)
        model.meta["cpu"] = cpu_name()
    model.save(args.out)
    fe = model.fit_error
    log(f"fitted {model.meta['steps']} steps; held-out relative error median {fe.median_rel:.1%}, "
        f"p90 {fe.p90_rel:.1%}; busy gap {model.gap_s * 1000:.2f} ms" if fe else "fitted")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
