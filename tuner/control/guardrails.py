"""The guardrails applied to a move: the search space narrowed around the applied config (policy bounds, the
guardrails' bounds, the largest change per move of each knob, frozen knobs held), a candidate projected into it,
and the cool-down between moves."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.knobs import KNOB_BY_NAME
from policies import Choices, KnobRange, Policy
from policies.control import Guardrails


def _window(current: float, factor: float) -> tuple[float, float]:
    return current / factor, current * factor


def _narrow(k: KnobRange, current: Any, guard: Guardrails) -> KnobRange | None:
    """The knob's range for one move from ``current``; None when it cannot move (frozen, or nothing allowed)."""
    if k.name in guard.frozen:
        return None
    low_b, high_b = guard.bounds.get(k.name, (-math.inf, math.inf))
    numeric = KNOB_BY_NAME[k.name].type in (int, float) and isinstance(current, (int, float))
    lo_w, hi_w = _window(float(current), guard.change_limit(k.name)) if numeric else (-math.inf, math.inf)
    d = k.domain
    if isinstance(d, Choices):
        allowed = tuple(v for v in d.values if not isinstance(v, (int, float)) or isinstance(v, bool)
                        or (low_b <= v <= high_b and lo_w - 1e-9 <= v <= hi_w + 1e-9))
        return KnobRange(k.name, choices=allowed) if len(allowed) > 1 or (allowed and allowed[0] != current) \
            else None
    kind = KNOB_BY_NAME[k.name].type
    low, high = max(float(d.low), low_b, lo_w), min(float(d.high), high_b, hi_w)
    if low > high:  # the applied value lies outside the space: one step toward it, as far as the limit allows
        target = lo_w if float(current) > high else hi_w
        low = high = target
    if kind is int:
        low, high = math.ceil(low - 1e-9), math.floor(high + 1e-9)
        if low > high:
            return None
    if low == high == current:
        return None
    # log stays log; a step no longer fits a moved low, so the narrowed range is plain
    return KnobRange(k.name, low=kind(low), high=kind(high), log=d.log and low > 0)


def move_policy(policy: Policy, current: dict[str, Any], resolved: dict[str, Any] | None = None) -> Policy:
    """``policy`` with its search space narrowed to the values one move from the applied config may reach (measured
    from the ``resolved`` values, e.g. chunk_size None read as the step budget); every knob that cannot move is fixed
    at its applied value (``current``, as the engine holds it). Raises ValueError when no knob can move."""
    guard = policy.control.guardrails
    resolved = {**current, **(resolved or {})}
    space, fixed = [], dict(policy.fixed)
    for k in policy.search_space:
        narrowed = _narrow(k, resolved.get(k.name), guard)
        if narrowed is None:
            fixed[k.name] = current.get(k.name)
        else:
            space.append(narrowed)
    if not space:
        raise ValueError("no searched knob can move within the guardrails from the applied config")
    return dataclasses.replace(policy, search_space=tuple(space), fixed=fixed, sampler="random")


def project(knobs: dict[str, Any], moved: Policy) -> dict[str, Any]:
    """``knobs`` (e.g. a study's best trial) brought within one move: each searched knob clamped into its narrowed
    range (the nearest choice), the fixed ones set, constraints repaired."""
    out = dict(moved.fixed)
    for k in moved.search_space:
        v, d = knobs.get(k.name), k.domain
        if isinstance(d, Choices):
            numeric = [c for c in d.values if isinstance(c, (int, float)) and not isinstance(c, bool)]
            if isinstance(v, (int, float)) and numeric:
                out[k.name] = min(numeric, key=lambda c: abs(math.log(max(c, 1e-9) / max(float(v), 1e-9))))
            else:
                out[k.name] = v if v in d.values else d.values[0]
        elif isinstance(v, (int, float)):
            out[k.name] = KNOB_BY_NAME[k.name].type(min(max(v, d.low), d.high))
        else:
            out[k.name] = d.low
    return moved.repair(out)


def changed(candidate: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The knobs of ``candidate`` whose value differs from the applied one (what a move PATCHes)."""
    return {k: v for k, v in candidate.items() if current.get(k) != v}


def within(candidate: dict[str, Any], current: dict[str, Any], policy: Policy) -> str | None:
    """Why ``candidate`` breaks a guardrail for a move from ``current`` (None when it keeps them all)."""
    guard = policy.control.guardrails
    for name, value in changed(candidate, current).items():
        if name in guard.frozen:
            return f"{name} is frozen (guardrails.frozen)"
        if name in guard.bounds and not guard.bounds[name][0] <= value <= guard.bounds[name][1]:
            return f"{name}={value} is outside guardrails.bounds.{name} {list(guard.bounds[name])}"
        old = current.get(name)
        if isinstance(value, (int, float)) and isinstance(old, (int, float)) and old > 0 and value > 0:
            ratio = max(value / old, old / value)
            if ratio > guard.change_limit(name) + 1e-9:
                return f"{name} {old} -> {value} changes by {ratio:.3g}x, more than the guardrail's " \
                       f"{guard.change_limit(name):g}x per move"
    return None


def cooldown_left(now: float, last_move_end: float | None, guard: Guardrails) -> float:
    """Seconds until the next move may start (0 when none is waiting)."""
    return 0.0 if last_move_end is None else max(0.0, last_move_end + guard.cooldown - now)
