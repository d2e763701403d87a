"""What ``tune`` says as it goes: its lines, and on a terminal a live line during a long measurement (what is being
measured, how far its load has run, how much of the run's time budget is left). A log or a pipe gets the lines
alone: the live line is drawn only where it can be redrawn in place. The same progress goes to a file
(``result_files.PROGRESS`` in the run's trials folder) that the dashboard's live page reads."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from engine.knobs import short_knobs
from slotune.units import format_duration
from tuner.measure.measurement import Measurement

PROG = "tune"
_CLEAR = "\r\033[K"  # back to the line's start, and erase it
WRITE_EVERY_S = 1.0  # the progress file is rewritten at most this often


def _live(stream: TextIO) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def say(text: str, stream: TextIO | None = None) -> None:
    """One of tune's lines (over the live line, where one is drawn)."""
    out = stream or sys.stdout
    print((_CLEAR if _live(out) else "") + text, file=out, flush=True)


@contextlib.contextmanager
def warning_lines(stream: TextIO | None = None) -> Iterator[None]:
    """Within it, a warning (the simulator's step shapes leaving the profile, say) is one of tune's own lines on
    stderr, ``tune: warning: ...``, where it happened, not Python's file, line number and source line."""
    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        say(f"{PROG}: warning: {message}", stream or sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def probe_line(m: Measurement) -> None:
    """A capacity search's probe, as it ends."""
    say(f"    {m.rate:.3g} req/s: {m.describe()}")


@dataclass
class LiveLine:
    """The load test's progress (TrialRunner.on_progress) as one line redrawn in place."""

    names: list[str]  # the knobs the line names (the searched ones)
    deadline: float | None = None  # time.monotonic() when the run's time budget ends
    stream: TextIO | None = None
    path: Path | None = None  # the progress file, rewritten at most every WRITE_EVERY_S seconds
    written_at: float = -float("inf")

    def __call__(self, progress: dict[str, Any]) -> None:
        out = self.stream or sys.stdout
        if _live(out):
            out.write(_CLEAR + self.text(progress))
            out.flush()
        if self.path is not None and time.monotonic() - self.written_at >= WRITE_EVERY_S:
            self.written_at = time.monotonic()
            self.write(self.path, progress)

    def write(self, path: Path, progress: dict[str, Any]) -> None:
        """The progress file, replaced whole (a reader never sees half of one)."""
        left = None if self.deadline is None else round(max(0.0, self.deadline - time.monotonic()), 1)
        record = {"updated": time.time(), "text": self.text(progress).strip(), "budget_left_s": left,
                  "progress": {k: v for k, v in progress.items() if isinstance(v, (int, float, str, dict, list))}}
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(record, default=str) + "\n")
        os.replace(partial, path)

    def text(self, p: dict[str, Any]) -> str:
        knobs = short_knobs(p.get("knobs") or {}, self.names) or "the config"
        line = (f"  measuring {knobs} at {float(p.get('rate') or 0.0):.3g} req/s: {float(p.get('elapsed_s') or 0.0):.0f}"
                f" of {float(p.get('duration_s') or 0.0):.0f}s of load (the first {float(p.get('warmup') or 0.0):.0f}s "
                f"warm-up), {int(p.get('ok') or 0)} finished, {int(p.get('in_flight') or 0)} in flight")
        if self.deadline is not None:
            line += f"; {format_duration(max(0.0, self.deadline - time.monotonic()))} of the run's budget left"
        return line
