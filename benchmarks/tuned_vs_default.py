"""Tuned vs untuned config at the same offered load, measured side by side on one engine.

For each workload (the scaled mixed workload and a time- and length-scaled Azure conversation trace) this runs
``tune`` (the real CLI, on an engine it starts) to get the tuned config and the offered rate, then starts one
engine and measures, alternating, the untuned config (vLLM's defaults for the same knobs: max_num_seqs 128,
max_num_batched_tokens 2048, block_size 16, chunked prefill on with no per-sequence chunk limit) and the tuned
one, ``--rounds`` times each, at that rate. It prints a markdown table (goodput, p99 TBT, p99 TTFT, attainment;
medians over rounds) and writes it with the raw figures to ``--out``.

    python benchmarks/tuned_vs_default.py --out bench-tuned --slo-p99-tbt 50ms
    python benchmarks/tuned_vs_default.py --out bench-tuned --slo-p99-tbt 100ms --rate 3
    python benchmarks/tuned_vs_default.py --out bench-tuned --skip-tune   # re-measure the tuned.yaml files there

Target: tuned goodput >= 1.5x the untuned one, with the tuned p99 TBT within the SLO.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slotune.slo import SLO
from slotune.units import format_duration, parse_duration
from policies import WorkloadSpec
from tuner.trials.engine_handle import ManagedEngine
from tuner.trials.trial_runner import TrialRunner

UNTUNED = {"max_num_seqs": 128, "max_num_batched_tokens": 2048, "block_size": 16, "chunk_size": None,
           "prefill_token_ratio": 1.0}
AZURE = REPO.parent / "shared" / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"
WORKLOADS: dict[str, dict[str, Any]] = {
    "mixed": {"workload": "mixed", "length_scale": 0.125},
    # conversation trace: prompts ~1k tokens, outputs ~200 -> x1/16; its timestamps rescaled to the tuned rate,
    # from 10 minutes in (its first seconds are sparse: 4 requests in 5 s against 5.5/s on average)
    "azure-conv": {"workload": str(AZURE), "length_scale": 0.0625, "trace_offset": 600.0},
}


def write_policy(path: Path, w: dict[str, Any], slo: float, trials: int, duration: float) -> None:
    policy = yaml.safe_load((REPO / "policies" / "default.yaml").read_text())
    policy["slo"]["tbt_p99"] = f"{slo * 1000:g}ms"
    policy["workload"] = {"name": w["workload"], "length_scale": w["length_scale"], "max_context": 2048,
                          "trace_offset": f"{w.get('trace_offset', 0.0):g}s"}
    policy["trials"] = trials
    policy["trial_duration"] = f"{duration:g}s"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


def run_tune(out: Path, name: str, w: dict[str, Any], args: argparse.Namespace) -> None:
    policy = out / f"{name}.policy.yaml"
    write_policy(policy, w, args.slo_p99_tbt, args.trials, args.trial_duration)
    cmd = [sys.executable, "-m", "tuner.commands.tune", "--policy", str(policy), "--out", str(out / f"{name}.yaml"),
           "--storage", str(out / "bench-study.db"), "--study-name", f"bench-{name}-{int(time.time())}",
           "--rate", args.rate]
    print(f"$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=out, check=False)


def median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def measure(out: Path, name: str, tuned: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    w = WORKLOADS[name]
    rate = float(tuned["rate_rps"])
    results: dict[str, list[dict[str, Any]]] = {"untuned": [], "tuned": []}
    with ManagedEngine(log_path=str(out / f"{name}.engine.log")) as handle:
        runner = TrialRunner(handle, workload=WorkloadSpec(name=w["workload"], length_scale=w["length_scale"],
                                                           max_context=2048, trace_offset=w.get("trace_offset", 0.0)),
                             rate=rate, duration=args.window, warmup=3.0, slo=SLO(tbt_p99=args.slo_p99_tbt),
                             pruning=None, seed=1)  # another seed than the study's: fresh arrivals
        for r in range(args.rounds):
            for label, knobs in (("untuned", UNTUNED), ("tuned", tuned["knobs"])):
                o = runner.run(knobs, out / f"{name}-measure" / f"{label}-{r}")
                s = o.summary
                results[label].append({k: s.get(k) for k in ("goodput_rps", "goodput_tokens_per_s", "tbt_p99",
                                                              "ttft_p99", "attainment", "requests", "completed",
                                                              "send_lag_p99")})
                print(f"  {name} round {r} {label}: goodput {s.get('goodput_rps') or 0:.2f} req/s, p99 TBT "
                      f"{format_duration(s.get('tbt_p99'))}, attainment {s.get('attainment')}", flush=True)
    row = {"workload": name, "rate_rps": rate, "tuned_knobs": tuned["knobs"]}
    for label in ("untuned", "tuned"):
        for k in ("goodput_rps", "tbt_p99", "ttft_p99", "attainment"):
            row[f"{label}_{k}"] = median([x[k] for x in results[label]])
    row["raw"] = results
    return row


def table(rows: list[dict[str, Any]], slo: float) -> str:
    lines = ["| workload | rate (req/s) | config | goodput (req/s) | p99 TBT | p99 TTFT | attainment |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        for label in ("untuned", "tuned"):
            att = row[f"{label}_attainment"]
            goodput = row[f"{label}_goodput_rps"] or 0.0
            lines.append(f"| {row['workload']} | {row['rate_rps']:.3g} | {label} | {goodput:.2f} "
                         f"| {format_duration(row[f'{label}_tbt_p99'])} | {format_duration(row[f'{label}_ttft_p99'])} "
                         f"| {'-' if att is None else f'{att:.0%}'} |")
        u, t = row["untuned_goodput_rps"] or 0.0, row["tuned_goodput_rps"] or 0.0
        ratio = "inf" if u == 0 and t > 0 else ("-" if u == 0 else f"{t / u:.2f}x")
        ok = row["tuned_tbt_p99"] is not None and row["tuned_tbt_p99"] <= slo
        lines.append(f"| {row['workload']} | | tuned/untuned | {ratio} | tuned within SLO: {'yes' if ok else 'no'} "
                     f"| | |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-tuned", help="folder for tuned configs, studies and measurements")
    p.add_argument("--slo-p99-tbt", type=parse_duration, default=0.050)
    p.add_argument("--rate", default="auto", help="offered load in req/s for tune and the comparison, or auto (tune "
                   "picks one the untuned config cannot fully serve)")
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--trial-duration", type=parse_duration, default=20.0)
    p.add_argument("--window", type=parse_duration, default=20.0, help="measurement window of the comparison")
    p.add_argument("--rounds", type=int, default=2, help="alternating measurements of each config")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    p.add_argument("--skip-tune", action="store_true", help="use the tuned YAML files already in --out")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.workloads.split(","):
        if not args.skip_tune:
            run_tune(out, name, WORKLOADS[name], args)
        path = out / f"{name}.yaml"
        if not path.exists():
            print(f"{name}: tune found no config within the SLO (no {path}); skipped", flush=True)
            continue
        rows.append(measure(out, name, yaml.safe_load(path.read_text()), args))
    text = table(rows, args.slo_p99_tbt)
    print(text)
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    (out / "results.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
