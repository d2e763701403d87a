"""The one protocol real and simulated trials implement, and the one mapping from a policy's workload to a load
configuration that both use.

A backend runs one trial (:meth:`TrialBackend.run`): the config's knobs laid over its base config, at an offered
rate, on the arrival draw ``seed``, its window ``duration`` seconds long (default: the backend's own); it writes
the trial folder (records.parquet, summary.json, steps.jsonl, trial.json; tuner/trials/trial_runner.py describes
it) and returns a TrialOutcome. ``tuner.trials.trial_runner.TrialRunner`` runs it on the engine,
``tuner.simulation.simulator_trial.SimTrialRunner`` in the simulator; measurements (tuner/measure/measurement.py),
rate searches (tuner/measure/capacity.py) and the verdict (tuner/measure/verdict.py) take either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from loadtest.config import LoadConfig
from slotune.slo import SLO
from loadtest.workloads import is_trace
from policies import WorkloadSpec


class TrialBackend(Protocol):
    slo: SLO
    simulated: bool

    def run(self, knobs: dict[str, Any], out_dir: Path, rate: float | None = None, seed: int | None = None, *,
            duration: float | None = None) -> Any: ...  # a tuner.trials.trial_runner.TrialOutcome


def load_config_for(workload: WorkloadSpec, slo: SLO, rate: float, duration: float, seed: int,
                    drain_timeout: float, url: str = "", out: str | None = None) -> LoadConfig:
    """The load test of one trial: the workload's lengths, mix, scales and trace window, the SLO, the arrival draw
    (for a trace: the segment of it that the draw picks, so that fresh draws replay other stretches of the trace and
    every config of a round the same one)."""
    extra: dict[str, Any] = {}
    if workload.mix:
        extra["mix"] = workload.mix
    if workload.mix_weights:
        extra["mix_weights"] = workload.mix_weights
    if workload.output_scale is not None:
        extra["output_scale"] = workload.output_scale
    if url:
        extra["url"] = url
    return LoadConfig(workload=workload.name, rate=rate, duration=duration, length_scale=workload.length_scale,
                      time_scale=workload.time_scale, max_context=workload.max_context,
                      trace_offset=workload.trace_offset, trace_segment_seed=seed if is_trace(workload.name) else None,
                      seed=seed, slo=slo, drain_timeout=drain_timeout,
                      request_timeout=max(30.0, drain_timeout), out=out, **extra)
