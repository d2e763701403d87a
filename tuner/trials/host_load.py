"""What else ran on this machine during a trial's load test: the CPU time of every process but this tuner's own
(itself, the engine it started, the load generator's processes), from the kernel's totals.

On a 2-core machine one busy process elsewhere takes a core from the engine or the load generator, and a config
measured then misses for a reason that is not its own. So a trial records the CPU other processes took, and one
where they took more than ``BUSY_CORES`` on average is a failure of the measuring machinery (its reason starts
"the machine was busy"): the measurement runs it again, and never counts it as the config's miss. An engine this
tuner did not start (``--engine-url`` on this machine) counts as its own when the process serving its port is
found; where it cannot be told apart from the rest, the figure is recorded but does not void the trial.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import psutil

BUSY_CORES = 0.25  # other processes' average CPU (cores) above which a window measured the machine, not the config
# (the policy's measurement.busy; its default)
BUSY_REASON = "the machine was busy"


def _busy_seconds() -> float:
    """CPU seconds every core spent on anything but idling, since boot (the hypervisor's steal included)."""
    t = psutil.cpu_times()
    return sum(float(getattr(t, name, 0.0)) for name in ("user", "nice", "system", "irq", "softirq", "steal"))


def own_cpu_seconds(also: tuple[int, ...] = ()) -> float:
    """CPU seconds of this process, its children that ended (and theirs), its living descendants, and the processes
    ``also`` (with theirs) where they are not among them."""
    me = psutil.Process(os.getpid())
    tree = {me.pid: me}
    for root in [me] + [p for p in _processes(also) if p.pid not in tree]:
        tree[root.pid] = root
        for child in _children(root):
            tree.setdefault(child.pid, child)
    total = 0.0
    for proc in tree.values():
        try:
            total += sum(proc.cpu_times()[:4])  # user, system, children_user, children_system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass  # ended between the listing and the read: its time is in its parent's children fields
    return total


def _processes(pids: tuple[int, ...]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.Error:
            pass
    return out


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


LOCAL_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::1")


def is_local(url: str) -> bool:
    return urlparse(url).hostname in LOCAL_HOSTS


def serving_pid(url: str) -> int | None:
    """The process listening on ``url``'s port when its host is this machine (None: remote, or not found)."""
    parsed = urlparse(url)
    if not is_local(url) or parsed.port is None:
        return None
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == parsed.port and conn.pid:
                return int(conn.pid)
    except (psutil.Error, OSError):
        return None
    return None


@dataclass
class HostLoad:
    """Other processes' CPU over an interval: ``start()``, then ``stop()`` -> their average cores."""

    judged: bool = True  # False where the engine's CPU could not be told apart from other processes'
    also: tuple[int, ...] = field(default_factory=tuple)  # processes counted as this tuner's own (an engine it found)
    _busy: float = 0.0
    _own: float = 0.0
    _wall: float = 0.0

    def start(self) -> HostLoad:
        self._busy, self._own, self._wall = _busy_seconds(), own_cpu_seconds(self.also), time.monotonic()
        return self

    def stop(self) -> dict[str, float | bool]:
        wall = max(1e-6, time.monotonic() - self._wall)
        other = max(0.0, (_busy_seconds() - self._busy) - (own_cpu_seconds(self.also) - self._own))
        return {"other_cores": round(other / wall, 3), "other_cpu_s": round(other, 2), "seconds": round(wall, 1),
                "cores": psutil.cpu_count() or 1, "judged": self.judged}


def busy_reason(host: dict[str, float | bool], busy: float | None = BUSY_CORES) -> str | None:
    """Why a window measured the machine rather than the config (None: it did not, or ``busy`` is None)."""
    cores = float(host.get("other_cores", 0.0))
    if busy is None or not host.get("judged") or cores <= busy:
        return None
    return (f"{BUSY_REASON}: other processes took {cores:.2f} cores on average during the load test "
            f"({float(host.get('other_cpu_s', 0.0)):.0f} CPU s in {float(host.get('seconds', 0.0)):.0f} s)")
