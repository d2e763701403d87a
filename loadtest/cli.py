"""``slotune loadtest``: replay a workload open-loop against an OpenAI-compatible server and summarize it.

    slotune loadtest --url http://127.0.0.1:8000 --workload mixed --rate 4 --duration 60s --out results/mixed \
        --slo-p99-tbt 50ms --slo-p99-ttft 2s
    slotune loadtest --url ... --workload traces/azure2023/AzureLLMInferenceTrace_conv.csv \
        --rate 2 --length-scale 0.25 --max-context 2048 --duration 2m --out results/conv --workers 2

Locust runs headless in its own process(es); this process prints a progress line, then the summary table.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from loadtest.config import OPTIONS, LoadConfig
from slotune.units import format_duration
from loadtest.summary import format_summary_table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slotune loadtest", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", required=True, help="base URL of the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--workers", type=int, default=1,
                   help="load processes (Locust master + N workers when > 1); the schedule is split among them")
    p.add_argument("--realtime", action="store_true",
                   help="run the load processes with a real-time priority (SCHED_RR; needs the privilege, else "
                        "ignored): keeps the generator on schedule when the server under test or anything else "
                        "saturates this machine's CPUs")
    p.add_argument("--nice", type=int, default=0,
                   help="niceness of the load processes (negative needs the privilege; only counts against "
                        "processes of the same cgroup)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    for o in OPTIONS:
        p.add_argument(f"--{o.flag}", default=o.default, help=o.help)
    return p


class ProgressLine:
    """One line, rewritten in place on a terminal; a plain line every few seconds otherwise."""

    def __init__(self, stream=sys.stderr, every_s: float = 5.0, lag_warn: float = 0.010) -> None:
        self.stream = stream
        self.lag_warn = lag_warn
        self.tty = stream.isatty()
        self.every_s = every_s
        self.last = 0.0
        self.width = 0

    def __call__(self, p: dict) -> None:
        lag = p.get("lag_p99")
        behind = lag is not None and lag > self.lag_warn
        text = (f"[{format_duration(max(p['elapsed_s'], 0.0)):>7} / {format_duration(p['duration_s'])}] "
                f"sent {p['sent']}/{p['scheduled']}  in flight {p['in_flight']}  ok {p['ok']}  failed {p['failed']}  "
                f"tokens {p['tokens']}  send lag p99 {format_duration(lag)}" + ("  BEHIND SCHEDULE" if behind else ""))
        if self.tty:
            self.stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
            self.stream.flush()
        elif time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = LoadConfig.from_strings(vars(args), url=args.url)
        from loadtest.runner import LoadTestError, run_loadtest
        from loadtest.schedule import build_schedule

        build_schedule(cfg)  # report option errors before starting anything
    except (ValueError, OSError) as e:
        print(f"slotune loadtest: {e}", file=sys.stderr)
        return 2
    progress = None if args.quiet else ProgressLine(lag_warn=cfg.lag_warn)

    def on_sigterm(signum, frame):  # like Ctrl-C: stop Locust cleanly, keep what was measured
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        summary = run_loadtest(cfg, workers=args.workers, on_progress=progress, nice=args.nice,
                               realtime=args.realtime)
    except LoadTestError as e:
        if progress:
            progress.close()
        print(f"slotune loadtest: failed: {e}", file=sys.stderr)
        return 1
    if progress:
        progress.close()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary_table(summary))
        out = summary.get("out") or cfg.out
        print(f"\nrecords and summary.json in {out or 'loadtest-results/'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
