"""The configs a screen sees: the whole allowed space when it holds no more than the screen's size, else a
space-filling design over it.

The design is a Latin hypercube over the searched knobs (scipy.stats.qmc, its centred discrepancy optimised), one
axis per knob: every knob's range is cut into as many strata as the screen has configs and each stratum is used once,
so each knob's values are all seen (when the screen has at least as many configs as the knob has values) and the
configs spread over the pairs of knobs instead of clustering. A log range is stratified on the log scale, as the
policy samples it. The design's seed is given by the caller (tune: ``--seed``, else a fresh one per run, kept in the
study): another seed sees other configs, and the same seed sees the same ones again.

Every config has its constraints repaired and appears once; ``params`` are the values drawn before the repair (what a
study enqueues, each inside its knob's distribution).
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import numpy as np
from scipy.stats import qmc

from policies import Choices, FloatRange, IntRange, KnobRange, Policy

Config = tuple[dict[str, Any], dict[str, Any]]  # (knobs with the constraints repaired, params as drawn)
DESIGN_ROUNDS = 20  # further designs of the same seed that top up configs lost to the repair's duplicates


def config_key(knobs: dict[str, Any]) -> str:
    return json.dumps(knobs, sort_keys=True)


def axis_values(k: KnobRange) -> list[Any] | None:
    """Every value the policy allows for ``k`` (None: a continuous range)."""
    d = k.domain
    if isinstance(d, Choices):
        return list(d.values)
    if isinstance(d, IntRange):
        return d.values()
    return k.grid_values() if d.step is not None else None


def space_size(policy: Policy) -> float:
    """How many value combinations the search space has before the repair (inf with a continuous range)."""
    size = 1.0
    for k in policy.search_space:
        values = axis_values(k)
        size *= math.inf if values is None else len(values)
    return size


def whole_space(policy: Policy) -> list[Config]:
    """Every config of the space, in the order of the product of its axes (constraints repaired, each once)."""
    axes = [[(k.name, v) for v in axis_values(k) or []] for k in policy.search_space]
    out: dict[str, Config] = {}
    for combo in itertools.product(*axes):
        params = dict(combo)
        knobs = policy.repair({**policy.fixed, **params})
        out.setdefault(config_key(knobs), (knobs, params))
    return list(out.values())


def value_at(k: KnobRange, u: float) -> Any:
    """The value of ``k`` at ``u`` in [0, 1): its ``u``-quantile under the policy's sampling (log-uniform on a log
    range, uniform over the listed values)."""
    d = k.domain
    if isinstance(d, Choices) or (isinstance(d, IntRange) and not d.log) or \
            (isinstance(d, FloatRange) and d.step is not None and not d.log):
        values = axis_values(k) or []
        return values[min(int(u * len(values)), len(values) - 1)]
    if isinstance(d, IntRange):  # log: uniform in log(v) over [low, high + 1), floored
        x = math.exp(math.log(d.low) + u * (math.log(d.high + 1) - math.log(d.low)))
        v = min(d.high, max(d.low, int(math.floor(x))))
        return v if d.step is None else d.low + (v - d.low) // d.step * d.step
    x = math.exp(math.log(d.low) + u * (math.log(d.high) - math.log(d.low))) if d.log else d.low + u * (d.high - d.low)
    if d.step is not None:
        x = d.low + round((x - d.low) / d.step) * d.step
    return min(d.high, max(d.low, x))


def latin_hypercube(policy: Policy, n: int, seed: int, round_: int = 0) -> list[Config]:
    """``n`` configs of a Latin hypercube over the searched knobs, design ``round_`` of ``seed`` (fewer when the
    repair merges some)."""
    space = list(policy.search_space)
    rng = np.random.default_rng([seed, round_])
    points = qmc.LatinHypercube(d=len(space), optimization="random-cd", rng=rng).random(n)
    out: list[Config] = []
    for row in points:
        params = {k.name: value_at(k, float(u)) for k, u in zip(space, row)}
        out.append((policy.repair({**policy.fixed, **params}), params))
    return out


def screen_design(policy: Policy, n: int, seed: int) -> list[Config]:
    """The screen's configs: the whole space when it has at most ``n`` combinations, else ``n`` distinct configs of
    a Latin hypercube on ``seed`` (topped up from further designs of it where the repair made duplicates)."""
    if space_size(policy) <= n:
        return whole_space(policy)
    seen: dict[str, Config] = {}
    for round_ in range(1 + DESIGN_ROUNDS):
        for knobs, params in latin_hypercube(policy, n if round_ == 0 else n - len(seen), seed, round_):
            seen.setdefault(config_key(knobs), (knobs, params))
        if len(seen) >= n:
            break
    return list(seen.values())[:n]


def design_words(policy: Policy, n: int, seed: int) -> str:
    """What a screen of ``n`` sees, in words: ``all 36 configs of the space`` or ``40 configs of a Latin hypercube
    over the 1536 combinations (design seed 123, kept in the study)``."""
    size = space_size(policy)
    if size <= n:
        return f"all {len(whole_space(policy))} configs of the space"
    of = f"the {size:.0f} combinations" if math.isfinite(size) else "the space"
    return f"{n} configs of a Latin hypercube over {of} (design seed {seed}, kept in the study)"
