"""What a trial's outcome means to the study: the objective value (goodput, or capacity), the SLO constraints
(Optuna's ``constraints_func``: value <= 0 means met) and the knobs a study trial asks for."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import optuna

from slotune.slo import SLO
from policies import Choices, IntRange, Policy
from tuner.measure.capacity import Capacity, CapacitySearcher
from tuner.measure.measurement import MACHINERY_RETRIES, machinery_failure
from tuner.trials.trial_backend import TrialBackend
# CONSTRAINTS_ATTR: the user attr constraints_func reads (Optuna stores its result in system attrs)
from tuner.search.trial_record import CONSTRAINTS_ATTR as CONSTRAINTS_ATTR, TrialRecord
from tuner.trials.trial_runner import TrialOutcome, TrialRunner
FAILED_VIOLATION = 1.0  # seconds: what a trial with no measurement violates each target by
CAPACITY_ATTAINMENT = 0.9  # capacity (DistServe's definition) = the highest rate with attainment >= 90 %


def suggest_knobs(trial: optuna.Trial, policy: Policy) -> dict[str, Any]:
    """The searched knobs sampled from the policy's space, the fixed ones added, constraints repaired."""
    knobs: dict[str, Any] = dict(policy.fixed)
    for k in policy.search_space:
        d = k.domain
        if policy.sampler == "grid":
            knobs[k.name] = trial.suggest_categorical(k.name, k.grid_values())
        elif isinstance(d, Choices):
            knobs[k.name] = trial.suggest_categorical(k.name, list(d.values))
        elif isinstance(d, IntRange):
            knobs[k.name] = trial.suggest_int(k.name, d.low, d.high, log=d.log, step=d.step or 1)
        else:
            knobs[k.name] = trial.suggest_float(k.name, d.low, d.high, log=d.log, step=d.step)
    return policy.repair(knobs)


def slo_constraints(outcome: TrialOutcome, slo: SLO) -> list[float]:
    """One value per SLO target: measured p99 minus target (seconds); > 0 = broken. A trial without a measurement
    (rejected, crashed, timed out) or stopped early breaks every target (a pruned one at least a little)."""
    targets = [(k, t) for k, t in (("tbt_p99", slo.tbt_p99), ("ttft_p99", slo.ttft_p99), ("e2e_p99", slo.e2e_p99))
               if t is not None]
    out = []
    for key, target in targets:
        value = outcome.summary.get(key) if outcome.summary else None
        v = FAILED_VIOLATION if value is None else float(value) - target
        if not outcome.feasible:
            v = max(v, 1e-3) if key == "tbt_p99" or value is None else v
        out.append(v)
    if not outcome.feasible and all(v <= 0 for v in out):
        out[0] = 1e-3  # infeasible for another reason (e.g. no request completed): still broken
    return out


def constraints_func(trial: optuna.trial.FrozenTrial) -> Sequence[float]:
    stored = TrialRecord.from_trial(trial).constraints
    return stored if stored is not None else [FAILED_VIOLATION]


def meets_constraints(trial: optuna.trial.FrozenTrial) -> bool:
    """A finished trial within every SLO target (its stored constraint values all <= 0)."""
    return trial.state == optuna.trial.TrialState.COMPLETE and all(c <= 0 for c in constraints_func(trial))


def goodput(outcome: TrialOutcome) -> float:
    v = outcome.summary.get("goodput_rps") if outcome.summary else None
    return 0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


@dataclass
class Evaluation:
    """A measured trial: its outcome (for capacity, that of the highest attaining rate) and objective value."""

    outcome: TrialOutcome
    value: float
    constraints: list[float]
    probes: list[dict[str, Any]]
    capacity: Capacity | None = None


def evaluate_goodput(runner: TrialRunner | TrialBackend, knobs: dict[str, Any], out_dir: Path,
                     prune: bool = True) -> Evaluation:
    """One window at the runner's rate; a window whose measuring machinery failed (a busy machine, a failed load
    test) is run again, as a measurement's is: it says nothing about the config."""
    for _ in range(1 + MACHINERY_RETRIES):
        o = runner.run(knobs, out_dir, prune=prune) if isinstance(runner, TrialRunner) else runner.run(knobs, out_dir)
        if not machinery_failure(o):
            break
    return Evaluation(o, goodput(o), slo_constraints(o, runner.slo), [])


def evaluate_capacity(searcher: CapacitySearcher, knobs: dict[str, Any], out_dir: Path,
                      start: float | None = None) -> Evaluation:
    """The config's capacity by a rate search (tuner/measure/capacity.py) from ``start`` (a positive prediction), else
    from what is known; the value is its searched capacity, the outcome the last window of the measurement there
    (feasible: some rate read served), the probes' figures go to the trial's attrs."""
    cap = searcher.search(knobs, out_dir, start=start if start else None)
    at = cap.at_capacity
    assert at is not None
    last = at.segments[-1] if at.segments else TrialOutcome(cap.knobs, {}, {}, False, at.reason, out_dir)
    outcome = TrialOutcome(cap.knobs, last.summary, last.step_stats, cap.feasible,
                           None if cap.feasible else (cap.rejected or f"no rate served ({cap.stopped})"),
                           last.out_dir, simulated=last.simulated, rate=at.rate)
    best_share = max((m.figures.attainment.value for m in cap.probes if m.figures and m.figures.requests), default=0.0)
    constraints = [0.0 if cap.feasible else max(1e-3, CAPACITY_ATTAINMENT - best_share)]
    return Evaluation(outcome, cap.value, constraints, [m.as_dict() for m in cap.probes], cap)
