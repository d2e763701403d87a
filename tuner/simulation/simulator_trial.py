"""Simulated trials: the same TrialOutcome and trial folder as a real trial (tuner.trials.trial_runner), with
``"simulated": true``, from the simulator instead of a load test against the engine.

    records.parquet, summary.json, steps.jsonl, trial.json  (see tuner/trials/trial_runner.py)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from engine.config import ConfigError, EngineConfig, ModelLimits
from loadtest.config import LoadConfig
from loadtest.records import write_records
from slotune.slo import SLO
from loadtest.summary import write_summary
from policies import WorkloadSpec
from tuner.simulation.simulator import DEFAULT_LIMITS, SimResult, StepTimer, simulate_load
from tuner.trials.step_stats import step_stats, window_steps
from tuner.trials.trial_backend import load_config_for
from tuner.trials.trial_runner import TRIAL_FORMAT, TrialOutcome, feasibility
from slotune import result_files as files


def write_trial_folder(out_dir: Path, result: SimResult, summary: dict[str, Any], outcome: TrialOutcome,
                       workload: dict[str, Any], slo: SLO, steps: list[dict[str, Any]] | None = None,
                       extra: dict[str, Any] | None = None) -> None:
    """records.parquet, summary.json, steps.jsonl and trial.json of a simulated run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_records(str(out_dir / files.RECORDS), result.records, meta={k: v for k, v in summary.items()
                                                                          if k != "warnings"})
    write_summary(str(out_dir / files.SUMMARY), summary)
    steps = steps if steps is not None else result.step_dicts()
    with open(out_dir / files.STEPS, "w", encoding="utf-8") as f:
        for s in steps:
            f.write(json.dumps(s) + "\n")
    trial = {"format": TRIAL_FORMAT, "knobs": outcome.knobs, "step_stats": outcome.step_stats,
             "feasible": outcome.feasible, "reason": outcome.reason, "workload": workload, "rate": outcome.rate,
             "slo": slo.as_dict(), "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "simulated": True, **(extra or {})}
    (out_dir / files.TRIAL).write_text(json.dumps(trial, indent=2) + "\n")


@dataclass
class SimTrialRunner:
    """TrialRunner's interface on the simulator: ``run(knobs, out_dir, rate)`` -> TrialOutcome (simulated).
    The window is [warmup, warmup + duration) of the schedule and its step records those from the window's opening
    to the end of the run (tuner.trials.step_stats.window_steps), as in a real trial."""

    timer: StepTimer
    limits: ModelLimits = DEFAULT_LIMITS
    workload: WorkloadSpec = field(default_factory=lambda: WorkloadSpec(name="mixed"))  # or a name (made a record)
    rate: float = 1.0
    duration: float = 20.0
    warmup: float = 3.0
    slo: SLO = field(default_factory=lambda: SLO(tbt_p99=0.05))
    seed: int = 0
    drain_timeout: float = 10.0
    base_knobs: dict[str, Any] = field(default_factory=dict)  # the config a trial's knobs are laid over
    backlog: int = 0  # requests already queued when a trial starts (a live engine's queue; see simulate_load)

    def __post_init__(self) -> None:
        self.workload = WorkloadSpec.of(self.workload)

    simulated = True

    def load_config(self, rate: float, seed: int | None, duration: float) -> LoadConfig:
        return load_config_for(self.workload, self.slo, rate, self.warmup + duration,
                               self.seed if seed is None else seed, self.drain_timeout)

    def served(self, result: SimResult, duration: float) -> float:
        """Requests of any arrival, a backlog's included, that finished within the window (``duration`` seconds from
        the warm-up's end), per second: behind a queue, the config's service rate (the window's own arrivals may not
        even have started)."""
        start, end = result.t0 + self.warmup, result.t0 + self.warmup + duration
        return sum(r.status == "ok" and start <= r.finish_time < end for r in result.records) / duration

    def run(self, knobs: dict[str, Any], out_dir: Path | None = None, rate: float | None = None,
            seed: int | None = None, duration: float | None = None) -> TrialOutcome:
        """Simulate one trial on arrival draw ``seed`` (default: the runner's) in a window of ``duration`` seconds
        (default: the runner's); with ``out_dir`` also write its trial folder. A config the engine would reject is an
        infeasible trial with the engine's reason."""
        rate = self.rate if rate is None else rate
        duration = duration or self.duration
        full = {**EngineConfig().knobs(), **self.base_knobs, **knobs}
        cfg = self.load_config(rate, seed, duration)
        try:
            result, summary = simulate_load(cfg, full, self.timer, limits=self.limits, slo=self.slo,
                                            window=(self.warmup, self.warmup + duration), backlog=self.backlog)
        except ConfigError as error:
            return TrialOutcome(knobs=full, summary={}, step_stats=step_stats([]), feasible=False,
                                reason=f"rejected by the engine: {error}", out_dir=out_dir, simulated=True, rate=rate)
        t0 = result.t0
        steps = window_steps(result.step_dicts(), t0 + self.warmup)  # as the engine's: the drain's steps too
        summary["served_rps"] = self.served(result, duration)
        reason = feasibility(summary, self.slo)
        outcome = TrialOutcome(knobs=full, summary=summary, step_stats=step_stats(steps), feasible=reason is None,
                               reason=reason, out_dir=out_dir, simulated=True, rate=rate)
        if out_dir is not None:
            write_trial_folder(Path(out_dir), result, summary, outcome, self.workload.as_dict(), self.slo, steps,
                               {"duration": duration, "warmup": self.warmup})
        return outcome
