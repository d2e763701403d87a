"""The retune's simulator search at the lowest CPU priority.

A retune screens some thirty configs on the simulator and redraws the pick: tens of seconds of CPU. Where the
controller shares cores with the engine it watches (a sidecar, or one small host), that time is taken from the
engine's steps exactly when the traffic has just changed, and the requests queued behind them miss. The search
therefore runs on a thread of its own at nice 19: the engine's steps come first and the search takes the time
between them. It takes longer on a busy host, and the controller's loop waits for it as before.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

RETUNE_NICENESS = 19  # the lowest priority Linux gives a thread; any user may lower a thread's priority


def lower_this_thread(niceness: int = RETUNE_NICENESS) -> bool:
    """Lower the calling thread's CPU priority (on Linux a thread's nice value is its own); False where the
    platform has no such call."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):  # no per-thread priorities here: the search runs at the controller's own
        return False
    return True


def at_low_priority(work: Callable[[], T], niceness: int = RETUNE_NICENESS) -> T:
    """``work()`` on a fresh daemon thread at ``niceness``: its result, or its exception raised here. A daemon,
    so that a controller stopped mid-search exits at once instead of finishing the search first."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        lower_this_thread(niceness)
        try:
            outcome.append(work())
        except BaseException as error:  # handed to the caller's thread, which decides what it means
            failure.append(error)

    thread = threading.Thread(target=run, name="slotune-retune", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
