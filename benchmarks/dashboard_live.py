"""How much of the Live page's poll interval building its figures takes, and how much JSON each poll sends to the
browser, for 100 / 1000 (the default window) / 5000 step records.

    python benchmarks/dashboard_live.py

The limit it is compared with: the poll interval (2 s by default); the work must stay a small fraction of it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import plotly.io as pio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dashboards.engine_client import HistogramBuckets
from dashboards.figures import itl_histogram_figure, step_timeline_figure
from tests.dashboard_data import step_records

POLL_INTERVAL_S = 2.0


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)  # no options: --help only
    buckets = HistogramBuckets([0.01, 0.025, 0.05, 0.1, float("inf")], [10.0, 300.0, 900.0, 990.0, 1000.0])
    print(f"{'steps':>6} {'build+serialize ms':>19} {'share of 2 s poll':>18} {'JSON KB':>8}")
    for n in (100, 1000, 5000):
        steps = step_records(n, 1_780_000_000.0)
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            figs = [step_timeline_figure(steps, wall_clock=True), itl_histogram_figure(buckets, 0.05)]
            payload = "".join(pio.to_json(f, validate=False) for f in figs)
            runs.append(time.perf_counter() - t)
        best = min(runs)
        print(f"{n:>6} {best * 1000:>19.1f} {best / POLL_INTERVAL_S:>17.1%} {len(payload) / 1024:>8.0f}")


if __name__ == "__main__":
    main()
