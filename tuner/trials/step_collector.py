"""A trial's step records, read from the engine while its load test runs.

The engine keeps its step records in a ring buffer (``slotune serve --step-buffer``, 10 000 by default): read once
after the load test, a fast engine's earliest records of the trial (its warm-up, then its window) were gone before
the read, and its step statistics came from part of its window without a word. :class:`StepCollector` reads
GET /debug/steps from the trial's cursor on, every ``interval`` seconds while the load test runs (called from the
load test's progress callback, which the runner's reader thread calls about once a second) and once more after it;
every read goes on from the last step the previous one got.

A read that finds the buffer moved past its cursor records a gap: how many records were dropped, between the start
times of the last record held before it and the first held after it. :meth:`StepCollector.dropped_in` counts the
dropped records of the gaps that reach into a window, so that a trial marks its step statistics as incomplete
rather than computing them from part of the window as if they were the whole.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tuner.trials.engine_handle import EngineError, EngineHandle

STEP_POLL_S = 2.0  # the engine's default buffer then holds every record down to 0.2 ms a step


@dataclass(frozen=True)
class StepGap:
    """Records the engine dropped before they were read: ``count`` steps that started between ``after_s`` (the
    start time of the last record held before them; None: the first read) and ``before_s`` (that of the first
    record held after them)."""

    count: int
    after_s: float | None
    before_s: float | None

    def reaches(self, start: float, end: float) -> bool:
        """Whether some of its records may have started in [start, end)."""
        return (self.before_s is None or self.before_s > start) and (self.after_s is None or self.after_s < end)


@dataclass
class StepCollector:
    """The step records after step ``since``, read in several calls (thread-safe: the progress thread polls, the
    trial's thread makes the last read)."""

    handle: EngineHandle
    since: int
    interval: float | None = STEP_POLL_S  # None: read only when asked (:meth:`read`)
    clock: Callable[[], float] = time.monotonic
    records: list[dict[str, Any]] = field(default_factory=list)
    gaps: list[StepGap] = field(default_factory=list)
    error: str | None = None  # why the latest read failed (None: it did not)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _next: float = field(default=math.inf, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.interval is not None:
            self._next = self.clock() + self.interval

    def poll(self) -> None:
        """Read when ``interval`` seconds have passed since the last read (the progress callback calls this)."""
        if self.clock() < self._next:
            return
        self.read()

    def read(self) -> bool:
        """Read the records after the last one read; False (and ``error``) when the engine did not answer."""
        with self._lock:
            if self.interval is not None:
                self._next = self.clock() + self.interval
            try:
                page = self.handle.step_page(self.since)
            except (EngineError, ValueError, KeyError) as error:  # no answer, or not one of /debug/steps
                self.error = str(error) or type(error).__name__
                return False
            self.error = None
            if page.dropped:
                self.gaps.append(StepGap(page.dropped, self.records[-1]["start_time"] if self.records else None,
                                         page.records[0]["start_time"] if page.records else None))
            self.records += page.records
            if page.records:
                self.since = int(page.records[-1]["step"])
            return True

    @property
    def dropped(self) -> int:
        """Records after the cursor that the engine dropped before they were read."""
        return sum(g.count for g in self.gaps)

    def dropped_in(self, start: float, end: float = math.inf) -> int:
        """Dropped records of the gaps that reach into [start, end) (wall clock): an upper bound of the window's
        missing records (a gap that straddles the window's opening counts whole)."""
        return sum(g.count for g in self.gaps if g.reaches(start, end))
