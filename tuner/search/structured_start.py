"""The structured start of a TPE study: where its first trials go, instead of Optuna's random start-up.

TPE's random start-up trials land anywhere in the space: with them TPE needed 0.5-0.93x random search's trials to
reach 95 % of the optimum (BENCHMARKS "Search methods on the simulator"). Under a latency SLO goodput rises with
max_num_seqs until the SLO breaks, so the optimum lies at that feasibility boundary. The structured start (policy
``start: structured``, TPE only) spends the start-up trials there instead: (1) "line": a bisection over
max_num_seqs (log scale, middle first) for its largest feasible value, the other knobs at the middle of their
ranges; (2) "step": around the best feasible line config and the first infeasible one above it, one step of each
scheduling knob (STEP_KNOBS), larger values first (more tokens per step: more goodput while the SLO holds; the
smaller ones can bring the boundary config back within it). Each next config follows from the study's finished
start trials only, so it is reproducible and a resumed study continues the start instead of repeating it. Then
TPE's model takes over.
"""

from __future__ import annotations

import json
import math
from typing import Any

import optuna
from optuna.trial import TrialState

from policies import Choices, IntRange, KnobRange, Policy
from tuner.search.objective import meets_constraints
# ROLE_START: a trial of the structured start (start_config); its START_STEP_ATTR says which part of the start:
# "line" (max_num_seqs bisection) or "step" (boundary steps)
from tuner.search.trial_record import (ROLE_START as ROLE_START, START_STEP_ATTR as START_STEP_ATTR, TrialRecord,
                                       start_attrs)


def startup_trials(policy: Policy) -> int:
    """The sampler's start-up trials (random, or the structured start): a short study must leave room for the
    model to guide it."""
    return max(2, min(10, policy.trials // 3))


LINE_KNOB = "max_num_seqs"
# The knobs that set a step's token count, hence its time; memory-layout knobs (block_size, ...) are left to TPE.
STEP_KNOBS = ("max_num_batched_tokens", "chunk_size", "prefill_token_ratio")


def _ordered_values(k: KnobRange) -> list[Any] | None:
    """Every value of a knob in increasing order: sorted numeric choices, each step of an int range; None for a
    float range or non-numeric choices."""
    d = k.domain
    if isinstance(d, Choices):
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in d.values):
            return sorted(d.values)
        return None
    return d.values() if isinstance(d, IntRange) else None


def _middle(k: KnobRange) -> Any:
    """The middle of a knob's range (geometric for a log range); the first listed of non-numeric choices."""
    values = _ordered_values(k)
    d = k.domain
    if isinstance(d, Choices):
        return values[len(values) // 2] if values is not None else d.values[0]
    low, high = float(d.low), float(d.high)
    mid = math.sqrt(low * high) if d.log else (low + high) / 2
    if values is not None:
        return min(values, key=lambda v: abs((math.log(v) if d.log else v) - (math.log(mid) if d.log else mid)))
    return mid if d.step is None else low + round((mid - low) / d.step) * d.step


def _neighbour(k: KnobRange, value: Any, direction: int) -> Any:
    """The next larger (direction +1) or smaller (-1) value: the adjacent choice, or x2 / /2 on a log range, or a
    quarter of the range; None at the edge or for non-numeric choices."""
    values = _ordered_values(k)
    d = k.domain
    if isinstance(d, Choices):
        if values is None or value not in values:
            return None
        i = values.index(value) + direction
        return values[i] if 0 <= i < len(values) else None
    if d.log:
        v = value * 2 if direction > 0 else value / 2
    else:
        v = value + direction * max(d.step or 0, (d.high - d.low) / 4)
    v = min(d.high, max(d.low, v))
    if isinstance(d, IntRange):
        v = int(round(v))
    return None if v == value else v


def _bisect_next(values: list[Any], lo: int, hi: int, log: bool) -> int | None:
    """The index strictly between lo and hi nearest the middle (geometric when log) of what is left; None when
    nothing is."""
    left = list(range(lo + 1, hi))
    if not left:
        return None
    f = math.log if log else float
    mid = (f(values[left[0]]) + f(values[left[-1]])) / 2
    return min(left, key=lambda i: (abs(f(values[i]) - mid), i))


def start_config(study: optuna.Study, policy: Policy) -> tuple[dict[str, Any], str] | None:
    """The next config of the structured start (params of the searched knobs, and its part: "line" or "step"), from
    the study's finished start trials; None when the start is over (or off, or one of its trials is still waiting
    or running: the next one depends on its result)."""
    if policy.start != "structured" or policy.sampler != "tpe" or LINE_KNOB not in policy.searched:
        return None
    line = policy.knob(LINE_KNOB)
    values = _ordered_values(line)
    if values is None:
        return None
    starts = [t for t in study.get_trials(deepcopy=False) if TrialRecord.from_trial(t).role == ROLE_START
              and t.state in (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)]
    if len(starts) >= startup_trials(policy) or any(t.state != TrialState.COMPLETE for t in starts):
        return None
    center = {k.name: _middle(k) for k in policy.search_space}
    lo, hi = -1, len(values)
    best: optuna.trial.FrozenTrial | None = None
    for t in starts:
        if TrialRecord.from_trial(t).start_step != "line" or t.params.get(LINE_KNOB) not in values:
            continue
        i = values.index(t.params[LINE_KNOB])
        if meets_constraints(t):
            lo = max(lo, i)
            if best is None or t.values[0] > best.values[0]:
                best = t
        else:
            hi = min(hi, i)
    following = _bisect_next(values, lo, hi, line.log)
    if following is not None:
        return {**center, LINE_KNOB: values[following]}, "line"
    if best is None:
        return None  # nothing on the line meets the SLO: TPE searches the whole space
    bases = [dict(best.params)] + ([{**best.params, LINE_KNOB: values[hi]}] if hi < len(values) else [])
    tried = {json.dumps(policy.repair({**policy.fixed, **t.params}), sort_keys=True) for t in starts}
    for direction in (1, -1):
        for k in policy.search_space:
            if k.name not in STEP_KNOBS:
                continue
            for base in bases:
                v = _neighbour(k, base[k.name], direction)
                params = {**base, k.name: v}
                if v is not None and json.dumps(policy.repair({**policy.fixed, **params}), sort_keys=True) \
                        not in tried:
                    return params, "step"
    return None


def enqueue_start(study: optuna.Study, policy: Policy) -> bool:
    """Enqueue the next config of the structured start (:func:`start_config`), if any, when nothing else waits in
    the queue (the default config, screened configs): the next ask runs it, and a study that ends before it never
    keeps a start trial waiting."""
    if study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        return False
    nxt = start_config(study, policy)
    if nxt is None:
        return False
    study.enqueue_trial(nxt[0], user_attrs=start_attrs(nxt[1]))
    return True
