"""`slotune SUBCOMMAND ...`: dispatches to the package that owns the subcommand, importing only that one
(the load generator's process must never import the engine, and the engine's must never import locust)."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with a `main(argv)`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("engine.cli", "generate text offline with the engine and print a per-request timing table"),
    "serve": ("engine.serve_cli", "serve the engine over an OpenAI-compatible HTTP API with metrics and live knobs"),
    "loadtest": ("loadtest.cli", "replay a workload open-loop against a server with Locust; write records and summary"),
    "tune": ("tuner.commands.tune", "search the knobs for the highest goodput within a latency SLO; write tuned.yaml"),
    "sweep": ("tuner.commands.sweep", "vary one knob with the rest fixed; measure throughput and latency at each value"),
    "dashboard": ("dashboards.cli", "Dash app: sweep curves, study history and Pareto front, live engine steps"),
    "simulate": ("tuner.commands.simulate", "a load test on the simulator (the engine's scheduler on a virtual clock)"),
    "control": ("tuner.control.cli", "staging: watch live traffic, retune on a trigger, canary, keep or roll back"),
    "calibrate": ("tuner.commands.calibrate", "profile the engine's step times and fit the simulator's step-time model"),
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in SUBCOMMANDS:
        lines = [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
        print("usage: slotune SUBCOMMAND [options]\n\nsubcommands:\n" + "\n".join(lines))
        if args and args[0] not in ("-h", "--help"):
            print(f"\nslotune: unknown subcommand {args[0]!r}", file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(SUBCOMMANDS[args[0]][0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
