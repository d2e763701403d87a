"""Where the load generator runs beside the engine: the arrangement that disturbs the measurement least.

On a machine where the load generator shares the engine's cores, each arrangement disturbs differently: a
real-time-priority generator keeps its schedule but preempts engine steps; a normal one is itself delayed (its
token timestamps late); separate cores for the two take cores from the engine. The floor (tuner/measure/floor.py) measures
one request at a time under each arrangement and keeps the first (real-time priority) unless another's client-side
p99 TBT is lower beyond the noise (the engine's own work is the same in each; what differs is what the arrangement
adds), reporting the engine-side p99 beside it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tuner.trials.engine_handle import ManagedEngine
from tuner.trials.trial_backend import TrialBackend
from tuner.trials.trial_runner import TrialRunner


@dataclass(frozen=True)
class Arrangement:
    name: str
    realtime: bool  # the generator at SCHED_RR priority (where permitted)
    separate: bool = False  # the generator on the last core, the engine on the others

    def describe(self) -> str:
        return {"realtime": "load generator at real-time priority, cores shared",
                "normal": "load generator at normal priority, cores shared",
                "separate": "load generator on a core of its own, the engine on the others"}[self.name]


REALTIME = Arrangement("realtime", True)
NORMAL = Arrangement("normal", False)
SEPARATE = Arrangement("separate", False, separate=True)


def candidates(runner: TrialBackend) -> list[Arrangement]:
    """The arrangements worth trying here: none for a simulated engine; separate cores only with >= 2 cores and an
    engine tune started."""
    if not isinstance(runner, TrialRunner):  # a simulated engine: no load generator beside it
        return []
    out = [REALTIME, NORMAL]
    if len(os.sched_getaffinity(0)) >= 2 and isinstance(runner.engine, ManagedEngine):
        out.append(SEPARATE)
    return out


def set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` to ``cpus`` (a process's affinity is per thread on Linux)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass


def apply(runner: TrialBackend, arrangement: Arrangement) -> None:
    """Arrange the runner's load generator (and the engine it owns) as ``arrangement`` says."""
    if not isinstance(runner, TrialRunner):
        return
    cpus = sorted(os.sched_getaffinity(0))
    runner.realtime = arrangement.realtime
    runner.generator_cpus = (cpus[-1],) if arrangement.separate else None
    if isinstance(runner.engine, ManagedEngine) and runner.engine.process is not None:
        engine_cpus = set(cpus[:-1]) if arrangement.separate else set(cpus)
        set_affinity(runner.engine.process.pid, engine_cpus)
