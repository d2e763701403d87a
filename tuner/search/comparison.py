"""Search methods compared on the simulator, where many seeds are affordable: best feasible goodput against trials
used, for TPE with constraints and the structured start (the tuner's default), TPE with Optuna's random start-up
("tpe-random-start"), Optuna's GP sampler, random search, and a grid in the style of vLLM's ``benchmarks/auto_tune``
(every max_num_seqs x max_num_batched_tokens pair in order, other knobs default).

As in ``tune``, a sampler's study first measures the engine's default config (one trial of the budget); the grid does
not (auto_tune has no such trial). ``default_trial=False`` leaves it out.

Every config of the (finite) search space is simulated once up front, so each method's trial costs a table lookup,
and the exhaustive optimum is known exactly. The samplers run in the tuner's own trial loop
(tuner.search.study.run_trials, with the structured start, constraint repair and the SLO as Optuna constraints, as in
a real study) on a backend that looks each config's outcome up (:class:`LookupBackend`).
"""

from __future__ import annotations

import itertools
import math
import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import optuna

from slotune.slo import SLO
from tuner.search.design import config_key as key, whole_space
from policies import Policy
from tuner.search.objective import goodput, slo_constraints
from tuner.search.study import TrialReport, enqueue_default, make_sampler, run_trials
from tuner.simulation.simulator_trial import SimTrialRunner
from tuner.trials.trial_runner import TrialOutcome

METHODS = ("tpe", "tpe-random-start", "gp", "random", "grid")


@dataclass(frozen=True)
class Point:
    goodput: float
    feasible: bool
    constraints: tuple[float, ...]
    outcome: TrialOutcome | None = None  # the simulated trial it came from (what the lookup backend returns)


@dataclass
class LookupBackend:
    """A trial backend whose trials are the simulated outcomes of the table (the default config under ``{}``)."""

    table: dict[str, Point]
    slo: SLO
    simulated: bool = True
    asked: list[dict[str, Any]] = field(default_factory=list)  # the configs the trial loop ran, in order

    def run(self, knobs: dict[str, Any], out_dir: Path, rate: float | None = None,
            seed: int | None = None, duration: float | None = None) -> TrialOutcome:
        self.asked.append(dict(knobs))
        outcome = self.table[key(knobs)].outcome
        assert outcome is not None
        return outcome


def space_configs(policy: Policy) -> list[dict[str, Any]]:
    """Every config of the policy's space (integer ranges at each step, by one when they have none; a float range
    needs a step), constraints repaired, deduplicated."""
    return [knobs for knobs, _ in whole_space(policy)]


def evaluate_space(policy: Policy, runner: SimTrialRunner, extra: Sequence[dict[str, Any]] = (),
                   progress: Callable[[int, int], None] | None = None) -> dict[str, Point]:
    """Simulate every config of the space (and ``extra`` ones, e.g. the grid's) once."""
    configs = space_configs(policy) + list(extra)
    table: dict[str, Point] = {}
    assert runner.slo is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # extrapolation is reported by the caller's own check, once
        for i, knobs in enumerate(configs):
            k = key(knobs)
            if k not in table:
                table[k] = point(runner.run(knobs), runner.slo)
            if progress is not None:
                progress(i + 1, len(configs))
    return table


def point(o: TrialOutcome, slo: SLO) -> Point:
    return Point(goodput(o), o.feasible, tuple(slo_constraints(o, slo)), o)


def grid_configs(policy: Policy) -> list[dict[str, Any]]:
    """vLLM auto_tune's loop: for each max_num_seqs, for each max_num_batched_tokens (the policy's grid values);
    the other searched knobs stay at the engine's defaults."""
    by_name = {k.name: k for k in policy.search_space}
    seqs = by_name["max_num_seqs"].grid_values()
    tokens = by_name["max_num_batched_tokens"].grid_values()
    out = []
    for s, t in itertools.product(seqs, tokens):
        knobs = {**policy.fixed, "max_num_seqs": s, "max_num_batched_tokens": t}
        if s <= t:  # the engine rejects more sequences than budget tokens; auto_tune would record a failure
            out.append(knobs)
    return out


def run_method(method: str, policy: Policy, table: dict[str, Point], trials: int, seed: int,
               grid: list[dict[str, Any]] | None = None, default: Point | None = None,
               backend: LookupBackend | None = None) -> list[float]:
    """Best feasible goodput after each trial (0 until a feasible one is found). ``default``: the engine's default
    config, measured as a sampler's first trial as ``tune`` does (the grid ignores it). ``backend``: the lookup
    backend to use (it records what was asked), else one on ``table``."""
    best, curve = 0.0, []
    if method == "grid":
        for knobs in (grid or grid_configs(policy))[:trials]:
            p = table[key(knobs)]
            best = max(best, p.goodput) if p.feasible else best
            curve.append(best)
        return curve
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # The tuner's own sampler settings for a study of this many trials (tuner.search.study.make_sampler).
    policy = policy.replace(sampler="tpe", start="random") if method == "tpe-random-start" else \
        policy.replace(sampler=method, start="structured" if method == "tpe" else policy.start)
    policy = policy.replace(trials=trials, objective="goodput")
    backend = backend or LookupBackend(table, policy.slo)
    if default is not None:
        backend.table = {**backend.table, key({}): default}

    def on_trial(r: TrialReport) -> None:  # the study's best trial is its best feasible one (study.best_trial)
        curve.append(r.best.values[0] if r.best is not None else 0.0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experimental-feature notices
        study = optuna.create_study(direction="maximize", sampler=make_sampler(policy, seed))
        if default is not None:
            enqueue_default(study)
        run_trials(study, backend, policy, trials, Path("comparison"), on_trial=on_trial)
    return curve


@dataclass
class Comparison:
    curves: dict[str, list[list[float]]]  # method -> one curve per seed
    optimum: float  # the best feasible goodput of the whole space (exhaustive)
    grid_best: float
    space_size: int
    trials: int
    meta: dict[str, Any] = field(default_factory=dict)

    def best_found(self) -> float:
        return max(max(c[-1] for c in cs) for cs in self.curves.values())

    def trials_to(self, method: str, share: float = 0.95) -> list[float]:
        """Per seed: trials until the best feasible goodput reaches ``share`` of the best any method found
        (inf when never)."""
        target = share * self.best_found()
        return [next((i + 1 for i, v in enumerate(c) if v >= target - 1e-12), math.inf) for c in self.curves[method]]

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"optimum": self.optimum, "best_found": self.best_found(), "grid_best": self.grid_best,
                               "space_size": self.space_size, "trials": self.trials, **self.meta, "methods": {}}
        for m, cs in self.curves.items():
            t95 = self.trials_to(m)
            finite = [t for t in t95 if math.isfinite(t)]
            out["methods"][m] = {
                "seeds": len(cs), "final_best_mean": statistics.fmean(c[-1] for c in cs),
                "trials_to_95pct": t95, "trials_to_95pct_median": statistics.median(t95) if t95 else None,
                "reached_95pct": f"{len(finite)}/{len(t95)}",
                "beats_grid_best": f"{sum(c[-1] >= self.grid_best - 1e-12 for c in cs)}/{len(cs)}"}
        return out


def compare(policy: Policy, runner: SimTrialRunner, trials: int = 60, seeds: int = 5,
            methods: tuple[str, ...] = METHODS, progress: Callable[[str], None] | None = None,
            default_trial: bool = True) -> Comparison:
    grid = grid_configs(policy)
    table = evaluate_space(policy, runner, grid)
    feasible = [p.goodput for p in table.values() if p.feasible]
    default = None
    if default_trial:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            o = runner.run({})  # the runner's base config: the engine's default
        assert runner.slo is not None
        default = point(o, runner.slo)
    curves: dict[str, list[list[float]]] = {}
    for m in methods:
        runs = 1 if m == "grid" else seeds
        curves[m] = [run_method(m, policy, table, trials if m != "grid" else len(grid), s, grid, default)
                     for s in range(runs)]
        if progress is not None:
            progress(f"{m}: {runs} runs")
    grid_points = [table[key(k)] for k in grid]
    return Comparison(curves=curves, optimum=max(feasible, default=0.0),
                      grid_best=max((p.goodput for p in grid_points if p.feasible), default=0.0),
                      space_size=len(table), trials=trials,
                      meta={"feasible_configs": len(feasible), "grid_size": len(grid),
                            "default_trial": None if default is None else {"goodput": default.goodput,
                                                                           "feasible": default.feasible}})


def plot(comparison: Comparison, path: str) -> str:
    """Best feasible goodput against trials (mean over seeds, min-max band), as a plotly HTML file."""
    import plotly.graph_objects as go  # plotly: heavy, only for the figure

    fig = go.Figure()
    colors = {"tpe": "#1f77b4", "tpe-random-start": "#9467bd", "gp": "#2ca02c", "random": "#ff7f0e",
              "grid": "#7f7f7f"}
    for m, cs in comparison.curves.items():
        n = max(len(c) for c in cs)
        xs = list(range(1, n + 1))
        cols = [[c[min(i, len(c) - 1)] for c in cs] for i in range(n)]
        mean = [statistics.fmean(v) for v in cols]
        if len(cs) > 1:
            fig.add_trace(go.Scatter(x=xs + xs[::-1], y=[max(v) for v in cols] + [min(v) for v in cols][::-1],
                                     fill="toself", line={"width": 0}, fillcolor=colors.get(m, "#000"),
                                     opacity=0.15, showlegend=False, hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=xs, y=mean, name=f"{m} ({len(cs)} seed{'s' if len(cs) > 1 else ''})",
                                 line={"color": colors.get(m)}))
    fig.add_hline(y=comparison.optimum, line_dash="dot", annotation_text="exhaustive optimum")
    fig.add_hline(y=0.95 * comparison.best_found(), line_dash="dash", annotation_text="95% of best found")
    fig.update_layout(title="Best feasible goodput vs trials (simulator)", xaxis_title="trials",
                      yaxis_title="best feasible goodput (req/s)", template="plotly_white")
    fig.write_html(path, include_plotlyjs="cdn")
    return path
