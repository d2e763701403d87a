"""``tune``: search the engine's batching knobs for the config that serves the most traffic within a latency SLO
(capacity: the highest offered rate at which >= 90 % of the requests attain it), with intervals and a paired verdict
against the default config.

    tune --slo-p99-tbt 50ms                      # capacity, p99 TTFT <= 2s from the default policy
    tune --slo-p99-tbt 50ms --slo-p99-ttft none  # no TTFT target
    tune --slo-p99-tbt 50ms --objective goodput --rate 2   # goodput at a fixed offered load
    tune --slo-p99-tbt 80ms --slo-p99-ttft 2s --workload trace.csv --rate 2 --trials 30 --trial-duration 30s
    tune --slo-p99-tbt 50ms --engine-url http://127.0.0.1:8000 --admin-token T --apply
    tune --slo-p99-tbt 50ms --storage postgresql://u:p@db/optuna --study-name shared   # several processes
    tune --slo-p99-tbt 50ms --engine vllm        # a vLLM server per configuration (docs/engines.md)

Without --engine-url it starts the default engine itself (and always stops it). The search space, constraints,
sampler, trial count and durations come from a policy (--policy FILE, default policies/default.yaml); flags
override it. Writes tuned.yaml (for `slotune serve --config`), tuned.vllm.txt and tuned.html next to it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from policies import OBJECTIVES, SAMPLERS, Policy, PolicyError, load_policy
from tuner.commands.engines import add_engine_flags, check_engine_args, check_policy, checked_knobs, server_kind
from tuner.commands.flags import CliError, check_workload, duration_arg
from tuner.commands.progress import PROG, warning_lines


NO_TARGET = -1.0  # --slo-p99-ttft none: drop the policy's target


def _duration_or_none(text: str) -> float:
    return NO_TARGET if text.strip().lower() == "none" else duration_arg(text)


def _rate_arg(text: str) -> float | None:
    if text.strip().lower() == "auto":
        return None
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be requests/s (a number > 0) or 'auto', got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def _int_at_least(text: str, least: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}") from None
    if v < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {text!r}")
    return v


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slo-p99-tbt", type=duration_arg, metavar="DURATION",
                   help="p99 time-between-tokens target, e.g. 50ms (default: the policy's)")
    p.add_argument("--slo-p99-ttft", type=_duration_or_none, metavar="DURATION|none",
                   help="p99 time-to-first-token target (default: the policy's, 2s); none drops it")
    p.add_argument("--workload", metavar="mixed|PATH", help="mixed, or a trace (.csv Azure, .jsonl Mooncake)")
    p.add_argument("--rate", type=_rate_arg, default=argparse.SUPPRESS, metavar="R|auto",
                   help="offered load in requests/s, or auto (default: the policy's, auto)")
    p.add_argument("--trials", type=_positive_int, metavar="N", help="trials in the study, the default config's "
                                                                      "included (default: the policy's)")
    p.add_argument("--trial-duration", type=duration_arg, metavar="DURATION",
                   help="measurement window of one trial, e.g. 30s (default: the policy's)")
    p.add_argument("--sampler", choices=SAMPLERS, help="default: the policy's (tpe)")
    p.add_argument("--objective", choices=OBJECTIVES, help="goodput at the offered load, or capacity (highest rate "
                                                           "with attainment >= 90%%)")
    p.add_argument("--policy", metavar="FILE", help="policy YAML (default: policies/default.yaml)")
    p.add_argument("--storage", metavar="URL", help="Optuna storage: sqlite:///FILE (default ./tune-study.db), "
                                                    "postgresql://..., journal:PATH or PATH.journal")
    p.add_argument("--study-name", metavar="NAME", help="study to create or resume (default: from workload/SLO/rate)")
    p.add_argument("--engine-url", metavar="URL", help="tune a running engine (default: start the default engine)")
    p.add_argument("--admin-token", metavar="T", help="the engine's admin token (or $SLOTUNE_ADMIN_TOKEN)")
    p.add_argument("--model", metavar="PATH", help="model of the engine tune starts (default: SmolLM2-135M)")
    p.add_argument("--out", default="tuned.yaml", metavar="FILE", help="tuned config (default: tuned.yaml)")
    p.add_argument("--apply", action="store_true", help="PATCH the tuned knobs into the engine at --engine-url "
                                                        "and leave them applied")
    p.add_argument("--screen", type=_positive_int, metavar="N",
                   help="screen N configs in the simulator first; the best few become the first trials on the engine "
                   "and the end report compares predicted with measured")
    p.add_argument("--seed", type=_non_negative_int, metavar="N",
                   help="the run's seed (default: the policy's, 0): the configs screened, the searches' and the "
                   "verdict's arrival draws all follow from it; a seed other than 0 names its own study")
    add_engine_flags(p)
    return p


def policy_from_args(args: argparse.Namespace) -> Policy:
    policy = load_policy(args.policy)
    slo = policy.slo
    if args.slo_p99_tbt is not None:
        slo = replace(slo, tbt_p99=args.slo_p99_tbt)
    if args.slo_p99_ttft is not None:
        slo = replace(slo, ttft_p99=None if args.slo_p99_ttft == NO_TARGET else args.slo_p99_ttft)
    changes: dict[str, Any] = {"slo": slo}
    if args.workload is not None:
        if args.workload != "mixed" and not Path(args.workload).is_file():
            raise CliError(f"argument --workload: no such file {args.workload!r} (use mixed or a trace file)")
        # a trace keeps its own lengths unless the policy scales them (names the same trace): the policy's scales
        # for another workload (the default policy's are for mixed) do not carry over to it
        if args.workload != policy.workload.name:
            keep = args.workload == "mixed"
            changes["workload"] = replace(policy.workload, name=args.workload,
                                          length_scale=policy.workload.length_scale if keep else 1.0,
                                          output_scale=policy.workload.output_scale if keep else None)
    if "rate" in args:
        changes["rate"] = args.rate
    for flag in ("trials", "trial_duration", "sampler", "objective", "seed"):
        if getattr(args, flag) is not None:
            changes[flag] = getattr(args, flag)
    policy = policy.replace(**changes)
    if getattr(args, "check", None):
        policy = check_policy(policy, checked_knobs(args.check))
    if policy.sampler == "grid":
        for k in policy.search_space:
            try:
                k.grid_values()
            except PolicyError as error:
                raise CliError(f"argument --sampler: grid: {error}") from None
    return policy


def check_args(args: argparse.Namespace) -> str | None:
    """Cross-flag checks; returns the admin token to use."""
    check_engine_args(args)
    token = args.admin_token or (os.environ.get("SLOTUNE_ADMIN_TOKEN") if args.engine_url else None)
    if args.engine_url:
        if not args.engine_url.startswith(("http://", "https://")):
            raise CliError(f"argument --engine-url: must be an http(s) URL, got {args.engine_url!r}")
        if not token:
            raise CliError("argument --admin-token: required with --engine-url (or set SLOTUNE_ADMIN_TOKEN)")
        if args.model:
            raise CliError("argument --model: only for the engine tune starts; the engine at --engine-url serves "
                           "its own model")
    else:
        if args.admin_token:
            raise CliError("argument --admin-token: only with --engine-url")
        if args.apply:
            raise CliError("argument --apply: needs --engine-url (the engine tune starts stops when tune ends)")
    if args.model and not Path(args.model).exists() and args.engine != "command":
        raise CliError(f"argument --model: no such file or folder {args.model!r}")
    if not args.out.endswith((".yaml", ".yml")):
        raise CliError(f"argument --out: must be a .yaml file, got {args.out!r}")
    return token


def _interrupt(signum: int, frame: Any) -> NoReturn:
    from tuner.trials.trial_runner import STOP  # httpx, numpy: heavy, not for --help or a flag error

    STOP.set()  # seen between the steps of a trial, should the exception below get swallowed
    raise KeyboardInterrupt  # SIGTERM gets the same clean-up as Ctrl-C: stop the engine, keep the study


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        token = check_args(args)
        policy = policy_from_args(args)
        check_workload(policy)
        kind = None
        if args.engine != "slotune":
            kind = server_kind(args, policy)
        from tuner.search.study import StorageError, open_storage  # optuna: heavy, not for --help or a flag error
        try:
            storage = open_storage(args.storage)
        except StorageError as error:
            raise CliError(f"argument --storage: {error}") from None
    except PolicyError as error:
        parser.exit(2, f"{PROG}: error: {'--policy ' if args.policy else ''}{error}\n")
    except CliError as error:
        parser.exit(2, f"{PROG}: error: {error}\n")
    signal.signal(signal.SIGTERM, _interrupt)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when started with SIGINT ignored
        signal.signal(signal.SIGINT, _interrupt)
    from tuner.commands.session import TuneSession  # optuna, scipy: heavy, not for --help or a flag error
    session = TuneSession(args, policy, storage, token, kind)
    try:
        with warning_lines():
            return session.run()
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted; finished trials are kept in the study "
              f"{session.study_name!r} (rerun the same command to resume)", file=sys.stderr)
        return 130
    finally:
        session.close()


if __name__ == "__main__":
    sys.exit(main())
