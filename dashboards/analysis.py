"""Plain functions the dashboard's figures mark: the knee of a one-knob sweep, the Pareto front of throughput
against p99 TBT, and the study's parameter importance. No plotting here, so tests check them on hand-made data."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import optuna

DEFAULT_MIN_GAIN = 0.10  # a step of the knob that adds less than 10 % throughput is past the knee
MIN_IMPORTANCE_TRIALS = 3  # completed trials with sampled knobs before importance (and more than the knobs searched)


@dataclass(frozen=True)
class Knee:
    """The point of a sweep past which raising the knob stops paying: `index` into the sorted points."""

    index: int
    value: float
    reason: str  # "gain": the next step adds < min_gain; "slo": the next step crosses the SLO


def _number(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return None if math.isnan(float(x)) else float(x)


def slo_crossing(latency: Sequence[float | None], slo: float | None) -> int | None:
    """Index of the first point whose latency is above the SLO (a missing latency counts as above: the point
    produced no tokens); None when every point meets it or there is no SLO."""
    if slo is None:
        return None
    for i, y in enumerate(latency):
        v = _number(y)
        if v is None or v > slo:
            return i
    return None


def find_knee(values: Sequence[float], throughput: Sequence[float | None],
              latency: Sequence[float | None] | None = None, slo: float | None = None,
              min_gain: float = DEFAULT_MIN_GAIN) -> Knee | None:
    """The knee of a sweep whose points are in increasing order of the knob `values`.

    Throughput knee: the first point where the next step of the knob raises throughput by less than `min_gain`
    (relative: (t[i+1] - t[i]) / t[i]). SLO knee: the last point before `latency` first crosses `slo`. The
    knee is the earlier of the two; None when throughput keeps growing and the SLO is never crossed, or when even
    the first point misses the SLO (there is nothing to the left of the crossing).
    """
    if len(values) != len(throughput) or (latency is not None and len(latency) != len(values)):
        raise ValueError("values, throughput and latency must have one entry per point")
    if any(_number(v) is None for v in values) or list(values) != sorted(values):
        raise ValueError("the knob values must be numbers in increasing order")
    candidates: list[Knee] = []
    for i in range(len(values) - 1):
        a, b = _number(throughput[i]), _number(throughput[i + 1])
        if a is None or b is None:
            continue
        gain = (b - a) / a if a > 0 else (math.inf if b > 0 else 0.0)
        if gain < min_gain:
            candidates.append(Knee(i, float(values[i]), "gain"))
            break
    if latency is not None:
        crossed = slo_crossing(latency, slo)
        if crossed is not None and crossed > 0:
            candidates.append(Knee(crossed - 1, float(values[crossed - 1]), "slo"))
    # at equal index the SLO reason wins: it is the stronger statement
    return min(candidates, key=lambda k: (k.index, k.reason != "slo")) if candidates else None


def pareto_front(throughput: Sequence[float | None], latency: Sequence[float | None]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher throughput, lower latency; at least as good
    on both and better on one), in increasing order of latency. Points missing either value are left out."""
    if len(throughput) != len(latency):
        raise ValueError("throughput and latency must have one entry per point")
    points = [(i, _number(t), _number(lat)) for i, (t, lat) in enumerate(zip(throughput, latency))]
    valid = [(i, t, lat) for i, t, lat in points if t is not None and lat is not None]
    front = []
    for i, t, lat in valid:
        dominated = any(t2 >= t and l2 <= lat and (t2 > t or l2 < lat) for j, t2, l2 in valid if j != i)
        if not dominated:
            front.append((lat, -t, i))
    return [i for _, _, i in sorted(front)]


def importance_gap(study: "optuna.Study") -> str:
    """Why the study's completed trials cannot rank its parameters yet ("" when they can): they must have sampled
    knobs (the default config samples none), be at least MIN_IMPORTANCE_TRIALS and more than the knobs searched (two
    trials differ in every knob at once: no share of the difference belongs to one), and not all score the same."""
    import optuna

    completed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    sampled = [t for t in completed if t.params and t.values]
    names = {k for t in sampled for k in t.params}
    needed = max(MIN_IMPORTANCE_TRIALS, len(names) + 1)
    if len(sampled) < needed:
        return (f"{len(sampled)} completed trial{'s' if len(sampled) != 1 else ''} with sampled knobs cannot rank "
                f"{len(names) or 'the'} parameter{'s' if len(names) != 1 else ''}: parameter importance needs at "
                f"least {needed} (the default config samples none)")
    if len({t.values[0] for t in sampled}) < 2:
        return "every completed trial scored the same: no parameter explains the objective"
    return ""


def param_importances(study: "optuna.Study") -> dict[str, float]:
    """Optuna's parameter importance of the objective (the first objective of a multi-objective study), over the
    completed trials; {} when they cannot rank the parameters (:func:`importance_gap`) or when the importance is
    undefined."""
    import optuna

    if importance_gap(study):
        return {}
    target = (lambda t: t.values[0]) if len(study.directions) > 1 else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "few trials per regime": the page shows the result as it is
            result = optuna.importance.get_param_importances(study, target=target)
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}
    return {k: float(v) for k, v in result.items() if not math.isnan(float(v))}
