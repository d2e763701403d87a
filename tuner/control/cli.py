"""``slotune control``: continuous retuning in staging.

    slotune control --engine-url http://127.0.0.1:8000 --admin-token T --policy policies/default.yaml \\
        --log controller.jsonl [--prometheus-url http://127.0.0.1:9090] [--storage tune-study.db] \\
        [--mode advisory|act] [--metrics-port 9400]
    slotune control --engine-url http://10.0.0.5:8000 --engine-url http://10.0.0.6:8000 ...   # a fleet
    slotune control --engine-url http://engine:8000 --discover ...    # every replica behind a service's DNS name

Watches the engine's metrics (its /metrics, or the same series through Prometheus), and on a trigger of the
policy (attainment below target, workload drift, schedule) retunes in the simulator within the guardrails, runs
the candidate as a leased canary against the applied config over the same traffic (on one engine the two take turns
in blocks; on a fleet two replicas trade them, the other as control at the same time), and keeps it everywhere or
rolls it back. ``--mode advisory`` decides and logs, applies
nothing. Every decision is one JSONL line in ``--log``; a restarted controller resumes from it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from types import FrameType

from policies import PolicyError, load_policy
from tuner.control.controller_metrics import ControllerMetrics
from tuner.control.decision_log import DecisionLog
from tuner.control.engine_admin import LeasingEngine
from tuner.control.loop import Controller
from tuner.control.sources import SourceUnavailable, discover, fleet_source
from tuner.control.window import off_bucket_targets


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slotune control", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-url", required=True, action="append", help="the engine (`slotune serve`): admin API "
                   "and step records; repeat it for each replica of a fleet (the load balancer in front of them "
                   "shares the traffic)")
    p.add_argument("--discover", action="store_true", help="--engine-url names a service: every address its host "
                   "name resolves to is a replica (Docker's or a headless Kubernetes service's DNS)")
    p.add_argument("--admin-token", default=None, help="the engine's admin token (default: $SLOTUNE_ADMIN_TOKEN; the "
                   "environment keeps it out of the process list, where any user can read a command line)")
    p.add_argument("--policy", default=None, help="policy YAML (default: the shipped policies/default.yaml)")
    p.add_argument("--prometheus-url", default=None, help="read the metrics through this Prometheus server")
    p.add_argument("--prometheus-selector", default="", help='label matchers for the engine\'s series, e.g. '
                   'job="engine" (with --prometheus-url)')
    p.add_argument("--storage", default=None, help="Optuna storage of the tuner's studies (warm start)")
    p.add_argument("--profile", default=None, help="the simulator's step-time profile (default: the shipped one)")
    p.add_argument("--mode", choices=("act", "advisory"), default="act")
    p.add_argument("--log", default="controller.jsonl", help="the decision log (JSONL, appended)")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between scrapes")
    p.add_argument("--metrics-port", type=int, default=None, help="serve slotune_controller_* metrics here")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--propose", default=None, metavar="JSON", help="canary this config once (an operator's move, "
                   "within the same lease and rollback rule), e.g. '{\"max_num_seqs\": 8}'")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: run on)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.admin_token = args.admin_token or os.environ.get("SLOTUNE_ADMIN_TOKEN")
    if not args.admin_token:
        parser.error("argument --admin-token: required (or set SLOTUNE_ADMIN_TOKEN)")
    try:
        policy = load_policy(args.policy)
    except PolicyError as error:
        print(f"slotune control: {error}", file=sys.stderr)
        return 2
    if args.poll <= 0:
        print("slotune control: --poll must be > 0", file=sys.stderr)
        return 2
    proposal = None
    if args.propose:
        try:
            proposal = json.loads(args.propose)
        except json.JSONDecodeError as error:
            print(f"slotune control: --propose: not JSON: {error}", file=sys.stderr)
            return 2
        if not isinstance(proposal, dict) or not proposal:
            print("slotune control: --propose: must be a JSON object of knobs", file=sys.stderr)
            return 2
    urls = [u.rstrip("/") for u in args.engine_url]
    if args.discover:
        try:
            urls = [u for url in urls for u in discover(url)]
        except SourceUnavailable as error:
            print(f"slotune control: --discover: {error}", file=sys.stderr)
            return 2
    source = fleet_source(urls, args.prometheus_url, args.prometheus_selector)
    metrics = ControllerMetrics()
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port, args.metrics_host)
    fleet = [LeasingEngine(url, args.admin_token) for url in urls]
    controller = Controller(policy, source, fleet[0], DecisionLog(args.log), metrics=metrics, mode=args.mode,
                            poll_s=args.poll, profile=args.profile, storage=args.storage, fleet=fleet)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.duration is not None:
        threading.Timer(args.duration, stop.set).start()
    print(f"slotune control: watching {source.description} ({args.mode}), log {args.log}", file=sys.stderr,
          flush=True)
    try:
        for note in off_bucket_targets(source.scrape(), controller.slo):
            print(f"slotune control: note: {note}", file=sys.stderr, flush=True)
    except SourceUnavailable:
        pass  # the loop says so, and waits for the source
    controller.run(stop.is_set, proposal)
    return 0


if __name__ == "__main__":
    sys.exit(main())
