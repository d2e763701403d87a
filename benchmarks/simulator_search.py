"""Search-method comparison on the simulator: TPE (structured / random start), GP, random, auto_tune-style grid.

    python benchmarks/simulator_search.py --profile tuner/simulation/default_profile.json --rate 1.5 --slo-p99-tbt 800ms \
        --slo-p99-ttft 10s --duration 40 --trials 60 --seeds 8 --out /tmp/search

Writes OUT/search.json (per method: trials to 95 % of the best found, per seed; final best) and OUT/search.html
(best feasible goodput against trials, mean and min-max band over seeds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slotune.units import parse_duration
from slotune.slo import SLO
from policies import default_policy_path, load_policy
from tuner.search.comparison import METHODS, compare, plot
from tuner.simulation.profiles import limits_of
from tuner.simulation.simulator_trial import SimTrialRunner
from tuner.simulation.step_time_model import StepTimeModel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=str(REPO / "tuner" / "default_profile.json"))
    p.add_argument("--policy", default=str(default_policy_path()))
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--slo-p99-tbt", default="150ms")
    p.add_argument("--slo-p99-ttft", default=None)
    p.add_argument("--duration", type=float, default=40.0, help="simulated measurement window per trial")
    p.add_argument("--trials", type=int, default=60)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--no-default-trial", action="store_true",
                   help="leave out the engine's default config, which tune measures as every study's first trial")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policy = load_policy(args.policy)
    model = StepTimeModel.load(args.profile)
    slo = SLO(tbt_p99=parse_duration(args.slo_p99_tbt),
              ttft_p99=parse_duration(args.slo_p99_ttft) if args.slo_p99_ttft else None)
    runner = SimTrialRunner(model, limits=limits_of(model), workload=policy.workload, rate=args.rate,
                            duration=args.duration, warmup=3.0, slo=slo)
    start = time.perf_counter()
    comparison = compare(policy, runner, trials=args.trials, seeds=args.seeds,
                         methods=tuple(args.methods.split(",")), default_trial=not args.no_default_trial,
                         progress=lambda s: print(f"[{time.perf_counter() - start:.0f}s] {s}", file=sys.stderr))
    summary = comparison.summary()
    summary.update(rate=args.rate, slo=slo.as_dict(), profile=args.profile, workload=policy.workload.as_dict(),
                   seconds=time.perf_counter() - start)
    (out / "search.json").write_text(json.dumps({"summary": summary, "curves": comparison.curves}, indent=2))
    plot(comparison, str(out / "search.html"))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
