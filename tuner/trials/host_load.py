"""What else ran on this machine during a trial's load test: the CPU time of every process but this tuner's own
(itself, the engine it started, the load generator's processes), from the kernel's totals.

On a 2-core machine one busy process elsewhere takes a core from the engine or the load generator, and a config
measured then misses for a reason that is not its own. So a trial records the CPU other processes took, and one
where they took more than ``BUSY_CORES`` on average is a failure of the measuring machinery (its reason starts
"the machine was busy"): the measurement runs it again, and never counts it as the config's miss. Where the engine
is not this tuner's own (``--engine-url``), its CPU time is not told apart from the rest: the figure is recorded
but does not void the trial.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

BUSY_CORES = 0.25  # other processes' average CPU (cores) above which a window measured the machine, not the config
BUSY_REASON = "the machine was busy"


def _busy_seconds() -> float:
    """CPU seconds every core spent on anything but idling, since boot (the hypervisor's steal included)."""
    t = psutil.cpu_times()
    return sum(float(getattr(t, name, 0.0)) for name in ("user", "nice", "system", "irq", "softirq", "steal"))


def own_cpu_seconds() -> float:
    """CPU seconds of this process, its children that ended (and theirs), and its living descendants."""
    me = psutil.Process(os.getpid())
    total = sum(me.cpu_times()[:4])  # user, system, children_user, children_system
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:4])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass  # ended between the listing and the read: its time is in its parent's children fields
    return total


@dataclass
class HostLoad:
    """Other processes' CPU over an interval: ``start()``, then ``stop()`` -> their average cores."""

    judged: bool = True  # False where the engine is not a descendant of this process (its CPU would count as other)
    _busy: float = 0.0
    _own: float = 0.0
    _wall: float = 0.0

    def start(self) -> HostLoad:
        self._busy, self._own, self._wall = _busy_seconds(), own_cpu_seconds(), time.monotonic()
        return self

    def stop(self) -> dict[str, float | bool]:
        wall = max(1e-6, time.monotonic() - self._wall)
        other = max(0.0, (_busy_seconds() - self._busy) - (own_cpu_seconds() - self._own))
        return {"other_cores": round(other / wall, 3), "other_cpu_s": round(other, 2), "seconds": round(wall, 1),
                "cores": psutil.cpu_count() or 1, "judged": self.judged}


def busy_reason(host: dict[str, float | bool]) -> str | None:
    """Why a window measured the machine rather than the config (None: it did not)."""
    cores = float(host.get("other_cores", 0.0))
    if not host.get("judged") or cores <= BUSY_CORES:
        return None
    return (f"{BUSY_REASON}: other processes took {cores:.2f} cores on average during the load test "
            f"({float(host.get('other_cpu_s', 0.0)):.0f} CPU s in {float(host.get('seconds', 0.0)):.0f} s)")
