"""Simulator fidelity: calibrate on the real engine, then on configs and workloads NOT used for calibration
(including a real Azure trace, scaled) compare the simulator's prediction with a real `slotune loadtest` against
`slotune serve`: throughput, p99 TBT, p99 TTFT. Target: within 10 % for throughput and p99 TBT.

    python benchmarks/simulator_fidelity.py --out /tmp/fidelity            # calibrates first (~3 min)
    python benchmarks/simulator_fidelity.py --out /tmp/fidelity --profile profile.json

Writes OUT/fidelity.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np

from engine.config import EngineConfig
from loadtest.config import LoadConfig
from slotune.slo import SLO
from loadtest.runner import run_loadtest
from tuner.commands.calibrate import CalibrationPlan, calibrate
from tuner.trials.engine_handle import ManagedEngine
from tuner.simulation.simulator import simulate_load
from tuner.simulation.profiles import limits_of
from tuner.simulation.step_time_model import StepTimeModel

# trace workloads, relative to --traces
TRACE = "azure2023/AzureLLMInferenceTrace_conv.csv"
CODE_TRACE = "azure2023/AzureLLMInferenceTrace_code.csv"
DEFAULT_TRACES = os.environ.get("SLOTUNE_TRACES", "traces")
# (name, knobs, load options): none of these configs or workloads is in the calibration plan.
CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("mixed x0.125, 6 seqs / 96 tok", {"max_num_seqs": 6, "max_num_batched_tokens": 96, "chunk_size": 48,
                                        "block_size": 16},
     {"workload": "mixed", "length_scale": 0.125, "rate": 0.8}),
    ("mixed x0.125 overloaded, 12 seqs / 160 tok", {"max_num_seqs": 12, "max_num_batched_tokens": 160,
                                                     "chunk_size": 32, "block_size": 32},
     {"workload": "mixed", "length_scale": 0.125, "rate": 3.0}),
    ("Azure conv x0.1, 8 seqs / 128 tok", {"max_num_seqs": 8, "max_num_batched_tokens": 128, "chunk_size": 64,
                                            "block_size": 16},
     {"workload": TRACE, "length_scale": 0.1, "max_context": 1024, "rate": 0.6, "trace_offset": 600.0}),
    ("Azure code x0.05, 4 seqs / 64 tok", {"max_num_seqs": 4, "max_num_batched_tokens": 64, "chunk_size": 64,
                                           "block_size": 8},
     {"workload": CODE_TRACE, "length_scale": 0.05, "max_context": 1024, "rate": 0.6, "trace_offset": 600.0}),
    # overloaded even on an idle machine (case 2 is overloaded only on a loaded one): throughput is then the engine's
    # capacity under this config, not the offered rate
    ("mixed x0.125 overloaded (6 req/s), 5 seqs / 80 tok", {"max_num_seqs": 5, "max_num_batched_tokens": 80,
                                                            "chunk_size": 40, "block_size": 32},
     {"workload": "mixed", "length_scale": 0.125, "rate": 6.0}),
]
METRICS = ("throughput_rps", "output_tokens_per_s", "tbt_p50", "tbt_p99", "ttft_p50", "ttft_p99", "goodput_rps")


def rel(pred: float | None, real: float | None) -> float | None:
    if pred is None or real is None or real == 0:
        return None
    return (pred - real) / real


def load_config(n: int, load: dict[str, Any], duration: float, url: str, out: Path) -> LoadConfig:
    return LoadConfig(url=url, duration=duration, slo=SLO(0.1), drain_timeout=30.0, request_timeout=60.0,
                      out=str(out / f"real{n}"), seed=7 + n, **load)


def compare_case(name: str, knobs: dict[str, Any], load: dict[str, Any], cfg: LoadConfig, real: dict[str, Any],
                 real_steps: list[dict[str, Any]], model: StepTimeModel,
                 rescaled: StepTimeModel | None = None, draws: int = 0) -> dict[str, Any]:
    engine_knobs = {**EngineConfig().knobs(), **knobs}
    _, sim = simulate_load(cfg, engine_knobs, model, limits=limits_of(model))
    row: dict[str, Any] = {"case": name, "knobs": knobs, "load": load,
                           "real": {m: real.get(m) for m in METRICS}, "sim": {m: sim.get(m) for m in METRICS},
                           "error": {m: rel(sim.get(m), real.get(m)) for m in METRICS},
                           "real_warnings": real.get("warnings"), "sim_warnings": sim.get("warnings")}
    if draws:
        tbt = p99_tbt_draws(cfg, engine_knobs, model, draws)
        row["sim_tbt_p99_draws"] = tbt
        row["error_tbt_p99_draws_median"] = rel(float(np.median(tbt)), real.get("tbt_p99"))
    if rescaled is not None:
        # What `tune --screen` predicts: the profile rescaled to another real run's steps (its default trial's)
        _, sim_rescaled = simulate_load(cfg, engine_knobs, rescaled, limits=limits_of(model))
        row.update(sim_rescaled={m: sim_rescaled.get(m) for m in METRICS},
                   error_rescaled={m: rel(sim_rescaled.get(m), real.get(m)) for m in METRICS})
    if real_steps:
        # The same simulation with the step-time model refitted on this run's own steps: what is left is the
        # scheduler / clock / HTTP structure, not the drift of the machine's speed since calibration.
        for st in real_steps:
            st["block_size"] = engine_knobs["block_size"]
        refit = model.refit(real_steps)
        _, sim_refit = simulate_load(cfg, engine_knobs, refit, limits=limits_of(model))
        row.update(sim_refit={m: sim_refit.get(m) for m in METRICS},
                   error_refit={m: rel(sim_refit.get(m), real.get(m)) for m in METRICS},
                   real_step_median_s=float(np.median([st["total_s"] for st in real_steps])),
                   predicted_step_median_s=float(np.median([model.predict_record(st) for st in real_steps])))
    return row


@dataclass
class ReseededTimer:
    """A step-time model whose step-variation draws use another seed (arrivals keep theirs): one more Monte-Carlo
    draw of the same simulation."""

    model: StepTimeModel
    draw: int

    def __post_init__(self) -> None:
        self.gap_s, self.request_latency_s = self.model.gap_s, self.model.request_latency_s
        self.token_latency_s = self.model.token_latency_s

    def bind(self, block_size: int, seed: int | None = 0) -> Any:
        return self.model.bind(block_size, (seed or 0) * 1000 + self.draw)

    def check_range(self, observed: dict[str, Any]) -> list[str]:
        return self.model.check_range(observed)


def p99_tbt_draws(cfg: LoadConfig, knobs: dict[str, Any], model: StepTimeModel, draws: int) -> list[float]:
    """The simulated p99 TBT under ``draws`` different draws of the step-to-step variation."""
    return [simulate_load(cfg, knobs, ReseededTimer(model, k), limits=limits_of(model))[1]["tbt_p99"]
            for k in range(draws)]


def real_steps_of(out: Path, n: int, knobs: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine's step records of case ``n``'s real run in ``out`` (each with the case's block size)."""
    steps_file = out / f"real{n}" / "engine_steps.jsonl"
    if not steps_file.exists():
        return []
    block_size = {**EngineConfig().knobs(), **knobs}["block_size"]
    return [{**json.loads(line), "block_size": block_size} for line in steps_file.read_text().splitlines()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--traces", default=DEFAULT_TRACES, help="folder of the Azure traces (default: $SLOTUNE_TRACES, "
                   "else ./traces)")
    p.add_argument("--profile", default=None, help="use this profile instead of calibrating")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--seconds-per-config", type=float, default=30.0)
    p.add_argument("--cases", default=None, help="comma-separated case numbers (1-based) to run")
    p.add_argument("--rescale-on", type=int, default=None, metavar="CASE",
                   help="with --resimulate: also simulate every other case with the profile rescaled to this case's "
                        "real steps (StepTimeModel.rescaled, as `tune --screen` does with its default trial's)")
    p.add_argument("--draws", type=int, default=0,
                   help="also simulate each case under this many draws of the step variation (Monte-Carlo spread "
                        "of the simulated p99 TBT)")
    p.add_argument("--resimulate", action="store_true",
                   help="no engine: simulate again (with --profile) against the real runs already in --out")
    args = p.parse_args()
    cases = [(name, knobs, {**load, "workload": str(Path(args.traces) / load["workload"])}
              if load.get("workload", "mixed") != "mixed" else load) for name, knobs, load in CASES]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    numbered = list(enumerate(cases))
    if args.cases:
        numbered = [numbered[int(i) - 1] for i in args.cases.split(",")]
    warnings.simplefilter("ignore")  # extrapolation is listed in each row's sim_warnings
    rows = []
    if args.resimulate:
        model = StepTimeModel.load(args.profile or out / "profile.json")
        rescaled = None
        if args.rescale_on is not None:
            on = args.rescale_on - 1
            rescaled = model.rescaled(real_steps_of(out, on, cases[on][1]))
            if rescaled is None:
                p.error(f"--rescale-on {args.rescale_on}: that case has too few real steps in {out}")
            r = rescaled.meta["rescaled"]
            print(f"profile rescaled to case {args.rescale_on}'s {r['steps']} steps: decode steps x{r['scale']:.3f}, "
                  f"prefill steps x{r['prefill_scale']:.3f}", file=sys.stderr)
        for n, (name, knobs, load) in numbered:
            real_dir = out / f"real{n}"
            if not (real_dir / "summary.json").exists():
                continue
            real = json.loads((real_dir / "summary.json").read_text())
            rows.append(compare_case(name, knobs, load, load_config(n, load, args.duration, "", out), real,
                                     real_steps_of(out, n, knobs), model,
                                     rescaled if args.rescale_on is not None and n != args.rescale_on - 1 else None,
                                     args.draws))
    else:
        with ManagedEngine(log_path=str(out / "engine.log")) as handle:
            if args.profile:
                model = StepTimeModel.load(args.profile)
            else:
                t = time.time()
                with tempfile.TemporaryDirectory() as tmp:
                    model = calibrate(handle, CalibrationPlan(seconds_per_config=args.seconds_per_config),
                                      Path(tmp), lambda s: print(s, file=sys.stderr, flush=True),
                                      out / "profile.steps.jsonl")
                model.save(out / "profile.json")
                print(f"calibrated in {time.time() - t:.0f}s, fit error {model.fit_error}", file=sys.stderr)
            base = handle.get_config()
            for n, (name, knobs, load) in numbered:
                handle.wait_idle(120)
                handle.patch_config({**base, **knobs})
                cfg = load_config(n, load, args.duration, handle.url, out)
                _, last = handle.steps(10**12)
                real = run_loadtest(cfg, realtime=True)
                handle.wait_idle(120)
                real_steps, _ = handle.steps(last)
                (out / f"real{n}" / "engine_steps.jsonl").write_text("".join(json.dumps(st) + "\n"
                                                                             for st in real_steps))
                rows.append(compare_case(name, knobs, load, cfg, real, real_steps, model, draws=args.draws))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    (out / ("fidelity-resimulated.json" if args.resimulate else "fidelity.json")).write_text(json.dumps(
        {"profile": args.profile, "profile_fit_error": model.to_dict()["fit_error"], "rows": rows}, indent=2))
    if args.draws:
        print(f"\np99 TBT under {args.draws} draws of the step variation (calibrated profile)\n")
        for r in rows:
            ms = [round(v * 1000) for v in r["sim_tbt_p99_draws"]]
            print(f"- {r['case']}: real {r['real']['tbt_p99'] * 1000:.0f} ms, simulated {min(ms)}-{max(ms)} ms, "
                  f"median {float(np.median(ms)):.0f} ms ({r['error_tbt_p99_draws_median']:+.0%})")
    for sim_key, err_key, title in (("sim", "error", "calibrated profile"),
                                    ("sim_rescaled", "error_rescaled",
                                     f"profile rescaled to case {args.rescale_on}'s real steps (tune --screen)"),
                                    ("sim_refit", "error_refit", "step-time model refitted on the run's own steps")):
        print(f"\n{title}\n")
        print("| case | throughput real / sim (err) | p99 TBT real / sim (err) | p99 TTFT real / sim (err) |")
        print("|---|---|---|---|")
        for r in rows:
            if sim_key not in r:
                continue
            cells = []
            for m, unit, scale in (("throughput_rps", " req/s", 1), ("tbt_p99", " ms", 1000),
                                   ("ttft_p99", " ms", 1000)):
                a, b, e = r["real"][m], r[sim_key][m], r[err_key][m]
                cells.append("-" if a is None or b is None or e is None else
                             f"{a * scale:.3g} / {b * scale:.3g}{unit} ({e:+.0%})")
            print(f"| {r['case']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
