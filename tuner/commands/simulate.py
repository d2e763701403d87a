"""``slotune simulate``: a load test on the simulator (the engine's scheduler and KV cache on a virtual clock, step
times from a calibrated profile). Writes a trial folder (records.parquet, summary.json, steps.jsonl, trial.json with
"simulated": true) and prints the same summary table as ``slotune loadtest``.

    slotune simulate --max-num-seqs 8 --max-num-batched-tokens 128 --workload mixed --length-scale 0.125 \
        --rate 2 --duration 5m --slo-p99-tbt 50ms --out sim/mixed
    slotune simulate --config tuned.yaml --workload traces/azure2023/AzureLLMInferenceTrace_conv.csv \
        --rate 1 --length-scale 0.125 --max-context 2048 --duration 1h --profile profile.json --out sim/conv
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from engine.cli import add_knob_arguments, knobs_from_args
from engine.config import ConfigError, EngineConfig
from engine.serve_cli import ConfigFileError, load_config_file
from loadtest.config import OPTIONS, LoadConfig
from loadtest.summary import format_summary_table
from tuner.simulation.profiles import limits_of, profile_path
from tuner.simulation.simulator import simulate_load
from tuner.simulation.simulator_trial import write_trial_folder
from tuner.simulation.step_time_model import ProfileError, StepTimeModel
from tuner.trials.step_stats import step_stats
from tuner.trials.trial_runner import TrialOutcome, feasibility

# Load-test flags that mean nothing without a server.
_SKIPPED = {"model", "out", "records-format", "lag-warn"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slotune simulate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="trial folder to write")
    p.add_argument("--config", default=None, metavar="FILE.yaml", help="knobs from a YAML file (tuned.yaml); "
                   "knob flags override it")
    p.add_argument("--profile", default=None, help="step-time profile from `slotune calibrate` (default: "
                   "$SLOTUNE_PROFILE, else the shipped profile of the default engine)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    for o in OPTIONS:
        if o.flag not in _SKIPPED:
            p.add_argument(f"--{o.flag}", default=o.default, help=o.help)
    add_knob_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def fail(message: str) -> int:
        print(f"slotune simulate: {message}", file=sys.stderr)
        return 2

    try:
        knobs: dict[str, Any] = load_config_file(args.config) if args.config else {}
    except ConfigFileError as error:
        return fail(str(error))
    knobs.update(knobs_from_args(args))
    path = profile_path(args.profile)
    try:
        model = StepTimeModel.load(path)
    except ProfileError as error:
        return fail(f"--profile: {error}")
    try:
        cfg = LoadConfig.from_strings({k: v for k, v in vars(args).items() if k != "out"})
    except ValueError as error:
        return fail(str(error))

    limits = limits_of(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result, summary = simulate_load(cfg, {**EngineConfig().knobs(), **knobs}, model, limits=limits)
        except ConfigError as error:
            return fail(f"--{error.knob.replace('_', '-')}: {error}")
        except (ValueError, OSError) as error:
            return fail(str(error))
    for w in caught:
        print(f"slotune simulate: warning: {w.message}", file=sys.stderr)
    slo = cfg.slo
    summary["profile"] = str(path)
    steps = result.step_dicts()
    reason = feasibility(summary, slo) if slo.tbt_p99 or slo.ttft_p99 or slo.e2e_p99 else None
    outcome = TrialOutcome(knobs=result.config.knobs(), summary=summary, step_stats=step_stats(steps),
                           feasible=reason is None, reason=reason, out_dir=Path(args.out), simulated=True,
                           rate=cfg.rate)
    workload = {"name": cfg.workload, "length_scale": cfg.length_scale, "time_scale": cfg.time_scale,
                "max_context": cfg.max_context, "mix": cfg.mix, "mix_weights": cfg.mix_weights}
    write_trial_folder(Path(args.out), result, summary, outcome, workload, slo, steps,
                       {"duration": cfg.duration, "warmup": 0.0, "profile": str(path)})
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary_table(summary))
        print(f"\nsimulated {len(steps)} steps in {result.wall_s:.2f}s; trial folder {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
