"""``slotune sweep``: vary one knob with the others fixed, and measure throughput and latency at each value.

    slotune sweep --knob max_num_seqs --values 4,8,16,32 --rate 2 --duration 20s --out results/sweep-seqs
    slotune sweep --knob chunk_size --values 16,32,64 --max-num-seqs 8 --workload trace.csv --rate 1 \\
        --engine-url http://127.0.0.1:8000 --admin-token T --out results/sweep-chunk

Each value is one trial of the tuner's TrialRunner (apply the knobs live, warm up, replay the workload, summarize
the window, keep the engine's step statistics) in its own trial folder ``OUT/KNOB=VALUE``; ``OUT/sweep.json``
(format slotune-sweep/1) lists the points and is rewritten after each one, so an interrupted sweep keeps what it
measured. Without --engine-url the default engine is started (and always stopped); with it, the engine's own
config is put back at the end. With --simulate the points come from the simulator (the engine's scheduler and KV
cache on a virtual clock, step times from a calibrated profile) in seconds, and the sweep is marked simulated.
SLO, workload scaling and warm-up default to the policy's (policies/default.yaml).
``slotune dashboard --results OUT/..`` draws the curves.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from slotune.units import format_duration
from engine.knobs import KNOB_BY_NAME, KNOB_NAMES
from policies import Policy, PolicyError, load_policy
from tuner.commands.flags import CliError, check_workload, duration_arg

PROG = "slotune sweep"
SWEEP_FORMAT = "slotune-sweep/1"


def parse_knob_value(name: str, text: str, flag: str) -> Any:
    """A knob value from the command line, typed and checked as engine.knobs describes it; errors name the flag."""
    knob = KNOB_BY_NAME[name]
    try:
        value = knob.parse(text)
    except ValueError:
        raise CliError(f"argument {flag}: {name} takes {knob.type.__name__} values, got {text.strip()!r}") from None
    reason = knob.check(value)
    if reason is not None:
        raise CliError(f"argument {flag}: {reason}, got {value!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--knob", required=True, choices=KNOB_NAMES, metavar="KNOB",
                   help=f"the knob to vary: {', '.join(KNOB_NAMES)}")
    p.add_argument("--values", required=True, metavar="V1,V2,...", help="its values, e.g. 4,8,16,32")
    p.add_argument("--rate", required=True, type=float, metavar="R", help="offered load in requests/s")
    p.add_argument("--duration", type=duration_arg, metavar="DURATION",
                   help="measurement window of each point, e.g. 20s (default: the policy's trial_duration)")
    p.add_argument("--warmup", type=duration_arg, metavar="DURATION", help="load before each window, not measured "
                                                                             "(default: the policy's)")
    p.add_argument("--workload", metavar="mixed|PATH", help="mixed, or a trace (.csv Azure, .jsonl Mooncake)")
    p.add_argument("--slo-p99-tbt", type=duration_arg, metavar="DURATION", help="default: the policy's")
    p.add_argument("--slo-p99-ttft", type=duration_arg, metavar="DURATION")
    p.add_argument("--policy", metavar="FILE", help="policy YAML for the defaults (default: policies/default.yaml)")
    p.add_argument("--engine-url", metavar="URL", help="sweep a running engine (default: start the default engine)")
    p.add_argument("--admin-token", metavar="T", help="the engine's admin token (or $SLOTUNE_ADMIN_TOKEN)")
    p.add_argument("--out", required=True, metavar="DIR", help="the sweep folder (sweep.json + one trial folder "
                                                               "per value)")
    p.add_argument("--simulate", action="store_true", help="measure each value on the simulator, not the engine")
    p.add_argument("--profile", metavar="FILE", help="with --simulate: step-time profile from `slotune calibrate` "
                                                     "(default: $SLOTUNE_PROFILE, else the shipped one)")
    fixed = p.add_argument_group("other knobs, fixed for every point (default: the policy's fixed knobs, then the "
                                 "engine's config)")
    for knob in KNOB_NAMES:
        fixed.add_argument(KNOB_BY_NAME[knob].flag, dest="fixed_" + knob, metavar="V")
    return p


@dataclass
class SweepPlan:
    knob: str
    values: list[Any]
    fixed: dict[str, Any]
    policy: Policy
    rate: float
    out: Path
    engine_url: str | None
    admin_token: str | None
    simulate: bool = False
    profile: str | None = None
    points: list[dict[str, Any]] = field(default_factory=list)


def plan_from_args(args: argparse.Namespace) -> SweepPlan:
    """Validated plan; a bad flag raises CliError naming it (nothing has started yet)."""
    values = [parse_knob_value(args.knob, v, "--values") for v in args.values.split(",") if v.strip()]
    if not values:
        raise CliError("argument --values: give at least one value, e.g. --values 4,8,16")
    if len(set(map(repr, values))) != len(values):
        raise CliError(f"argument --values: a value is repeated in {args.values!r}")
    if not (args.rate > 0 and args.rate != float("inf")):
        raise CliError(f"argument --rate: must be > 0, got {args.rate:g}")
    try:
        policy = load_policy(args.policy)
    except PolicyError as error:
        raise CliError(f"argument --policy: {error}") from None
    fixed = dict(policy.fixed)
    for knob in KNOB_NAMES:
        text = getattr(args, "fixed_" + knob)
        if text is None:
            continue
        flag = KNOB_BY_NAME[knob].flag
        if knob == args.knob:
            raise CliError(f"argument {flag}: {knob} is the knob being swept (give its values with --values)")
        fixed[knob] = parse_knob_value(knob, text, flag)
    fixed.pop(args.knob, None)
    slo = policy.slo
    if args.slo_p99_tbt is not None:
        slo = replace(slo, tbt_p99=args.slo_p99_tbt)
    if args.slo_p99_ttft is not None:
        slo = replace(slo, ttft_p99=args.slo_p99_ttft)
    changes: dict[str, Any] = {"slo": slo, "rate": args.rate}
    if args.workload is not None:
        if args.workload not in ("mixed", "prefix") and not Path(args.workload).is_file():
            raise CliError(f"argument --workload: no such file {args.workload!r} (use mixed or a trace file)")
        scale = policy.workload.length_scale if args.workload == "mixed" else 1.0
        changes["workload"] = replace(policy.workload, name=args.workload, length_scale=scale)
    if args.duration is not None:
        changes["trial_duration"] = args.duration
    if args.warmup is not None:
        changes["warmup"] = args.warmup
    policy = policy.replace(**changes)
    check_workload(policy)
    token = args.admin_token or (os.environ.get("SLOTUNE_ADMIN_TOKEN") if args.engine_url else None)
    if args.engine_url:
        if not args.engine_url.startswith(("http://", "https://")):
            raise CliError(f"argument --engine-url: must be an http(s) URL, got {args.engine_url!r}")
        if not token:
            raise CliError("argument --admin-token: required with --engine-url (the sweep applies knobs with "
                           "PATCH /admin/config), or set SLOTUNE_ADMIN_TOKEN")
    elif args.admin_token:
        raise CliError("argument --admin-token: only with --engine-url")
    if args.simulate and args.engine_url:
        raise CliError("argument --simulate: the simulator replaces the engine; leave out --engine-url")
    if args.profile and not args.simulate:
        raise CliError("argument --profile: only with --simulate")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"argument --out: {out} exists and is not a folder")
    return SweepPlan(knob=args.knob, values=values, fixed=fixed, policy=policy, rate=args.rate, out=out,
                     engine_url=args.engine_url, admin_token=token, simulate=args.simulate, profile=args.profile)


def point_dir(knob: str, value: Any) -> str:
    return f"{knob}={str(value).lower() if isinstance(value, bool) else value}"


def sweep_document(plan: SweepPlan) -> dict[str, Any]:
    """The sweep.json document (format slotune-sweep/1) of the points measured so far."""
    slo = plan.policy.slo
    return {"format": SWEEP_FORMAT, "knob": plan.knob, "values": plan.values, "fixed": plan.fixed,
            "workload": plan.policy.workload.name, "rate": plan.rate, "slo": slo.as_dict(),
            "simulated": plan.simulate, "duration": plan.policy.trial_duration, "warmup": plan.policy.warmup,
            "points": plan.points}


def write_sweep(plan: SweepPlan) -> Path:
    path = plan.out / "sweep.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(sweep_document(plan), indent=2) + "\n")
    tmp.replace(path)  # a reader (the dashboard) never sees half a file
    return path


def _fmt(x: Any, scale: float = 1.0, unit: str = "") -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x * scale:.4g}{unit}"


def engine_runner(plan: SweepPlan, engine: Any) -> Any:
    """The tuner's TrialRunner on `engine` (an EngineHandle, or a started ManagedEngine)."""
    from tuner.trials.trial_runner import TrialRunner  # httpx, numpy: heavy, not for --help or a flag error

    p = plan.policy
    return TrialRunner(engine, workload=p.workload, rate=plan.rate, duration=p.trial_duration, warmup=p.warmup,
                       slo=p.slo, seed=p.seed, busy_cores=p.measurement.busy)


def simulator_runner(plan: SweepPlan) -> Any:
    """The simulator's SimTrialRunner (same run(knobs, out_dir) -> TrialOutcome), with the calibrated profile."""
    from tuner.simulation.profiles import limits_of, profile_path  # the simulator (numpy): only with --simulate
    from tuner.simulation.simulator_trial import SimTrialRunner  # the simulator: only with --simulate
    from tuner.simulation.step_time_model import ProfileError, StepTimeModel  # numpy: only with --simulate

    try:
        model = StepTimeModel.load(profile_path(plan.profile))
    except ProfileError as error:
        raise CliError(f"argument --profile: {error}") from None
    p = plan.policy
    return SimTrialRunner(model, limits=limits_of(model), workload=p.workload, rate=plan.rate,
                          duration=p.trial_duration, warmup=p.warmup, slo=p.slo, seed=p.seed)


def run_sweep(plan: SweepPlan, runner: Any) -> list[dict[str, Any]]:
    """Measure every value with `runner` (TrialRunner or SimTrialRunner); returns the points (also written to
    OUT/sweep.json after each)."""
    plan.out.mkdir(parents=True, exist_ok=True)
    print(f"{'value':>10} {'tokens/s':>9} {'goodput':>8} {'p99 TBT':>9} {'p99 TTFT':>9}  feasible", flush=True)
    for value in plan.values:
        name = point_dir(plan.knob, value)
        outcome = runner.run({**plan.fixed, plan.knob: value}, plan.out / name)
        s = outcome.summary
        plan.points.append({"value": value, "dir": name, "summary": s, "step_stats": outcome.step_stats,
                            "feasible": outcome.feasible, "reason": outcome.reason})
        write_sweep(plan)
        print(f"{str(value):>10} {_fmt(s.get('output_tokens_per_s')):>9} {_fmt(s.get('goodput_rps')):>8} "
              f"{_fmt(s.get('tbt_p99'), 1000, 'ms'):>9} {_fmt(s.get('ttft_p99'), 1, 's'):>9}  "
              f"{'yes' if outcome.feasible else 'no: ' + str(outcome.reason)}", flush=True)
    return plan.points


def _sigterm(signum: int, frame: Any) -> NoReturn:
    raise KeyboardInterrupt  # same clean-up as Ctrl-C: keep the points, stop or restore the engine


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = plan_from_args(args)
        simulator = simulator_runner(plan) if plan.simulate else None
    except CliError as error:
        parser.exit(2, f"{PROG}: error: {error}\n")
    # httpx, numpy: heavy, not for --help or a flag error
    from tuner.trials.engine_handle import EngineError, EngineHandle, ManagedEngine

    previous_sigterm = signal.signal(signal.SIGTERM, _sigterm)
    p = plan.policy
    print(f"{'simulated ' if plan.simulate else ''}sweep of {plan.knob} over {', '.join(map(str, plan.values))}: "
          f"workload {p.workload.name}, {plan.rate:g} req/s, {format_duration(p.trial_duration)} per point after "
          f"{format_duration(p.warmup)} warm-up; SLO p99 TBT {format_duration(p.slo.tbt_p99)}", flush=True)
    managed: ManagedEngine | None = None
    handle: EngineHandle | None = None
    original: dict[str, Any] | None = None
    try:
        if simulator is not None:
            runner = simulator
        elif plan.engine_url:
            handle = EngineHandle(plan.engine_url, plan.admin_token)
            original = handle.get_config()
            runner = engine_runner(plan, handle)
        else:
            print("starting the default engine ...", flush=True)
            managed = ManagedEngine(knobs=plan.fixed)
            managed.start()
            runner = engine_runner(plan, managed)
        run_sweep(plan, runner)
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted; {len(plan.points)} point(s) kept in {plan.out / 'sweep.json'}", file=sys.stderr)
        return 130
    except EngineError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        if managed is not None:
            managed.stop()
        if handle is not None and original is not None:
            try:
                handle.patch_config(original)
            except Exception as error:  # report, the sweep's results are already written
                print(f"{PROG}: could not restore the engine's config: {error}", file=sys.stderr)
    print(f"wrote {plan.out / 'sweep.json'}; see it with: slotune dashboard --results {plan.out.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
