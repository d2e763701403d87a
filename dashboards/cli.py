"""`slotune dashboard`: the Dash app with the Curves, Study, Live and Trial detail pages.

  slotune dashboard --results results/ --storage sqlite:///tune-study.db --engine-url http://127.0.0.1:8000

Every source is optional: a page without its source says what to pass. The admin token (for the exact current
config on the Live page) comes from --admin-token or SLOTUNE_ADMIN_TOKEN; without it the knobs come from /metrics.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from urllib.parse import urlparse

from dashboards.app import DashboardSettings, create_app
from tuner.search.study import DEFAULT_STORAGE  # where `tune` keeps its study unless told otherwise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotune dashboard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", default=None, help="the tuner's Optuna storage: sqlite:///FILE, postgresql://..., "
                                                        "journal:PATH or PATH.journal (default: ./tune-study.db, "
                                                        "tune's default, when it exists)")
    parser.add_argument("--results", default=None, metavar="DIR", help="folder with sweep and trial folders")
    parser.add_argument("--engine-url", default=None, metavar="URL", help="a running `slotune serve`, for Live")
    parser.add_argument("--admin-token", default=None, help="bearer token of the engine's /admin/config "
                                                            "(default: $SLOTUNE_ADMIN_TOKEN)")
    parser.add_argument("--controller-log", default=None, metavar="FILE", help="`slotune control --log` (JSONL), "
                        "for the Controller page")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8050)
    parser.add_argument("--poll-interval", type=float, default=2.0, metavar="SECONDS",
                        help="how often the Live page polls the engine (default 2)")
    return parser


def settings_from_args(args: argparse.Namespace) -> DashboardSettings:
    """Validated settings; a bad value raises ValueError naming the flag."""
    results = Path(args.results) if args.results else None
    if results is not None and not results.is_dir():
        raise ValueError(f"--results: {results} is not a folder")
    if args.engine_url is not None:
        url = urlparse(args.engine_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ValueError(f"--engine-url: expected http://HOST:PORT, got {args.engine_url!r}")
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port: must be 1..65535, got {args.port}")
    if not 0.2 <= args.poll_interval <= 3600:
        raise ValueError(f"--poll-interval: must be 0.2..3600 seconds, got {args.poll_interval:g}")
    storage = args.storage or (DEFAULT_STORAGE if Path(DEFAULT_STORAGE[len("sqlite:///"):]).exists() else None)
    return DashboardSettings(storage=storage, results=results,
                             engine_url=args.engine_url.rstrip("/") if args.engine_url else None,
                             admin_token=args.admin_token or os.environ.get("SLOTUNE_ADMIN_TOKEN") or None,
                             poll_interval_s=args.poll_interval,
                             controller_log=Path(args.controller_log) if args.controller_log else None)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as error:
        print(f"slotune dashboard: {error}", file=sys.stderr)
        return 2
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per poll
    app = create_app(settings)
    print(f"slotune dashboard on http://{args.host}:{args.port}/", flush=True)
    app.run(host=args.host, port=args.port, debug=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
