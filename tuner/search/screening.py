"""Screening: simulate many configs from a policy's search space, rank them by simulated goodput under the SLO,
and confirm the best few on the engine (predicted against measured, side by side).

    ranked = screen(policy, 1000, SimTrialRunner(model, ...))        # seconds to minutes
    rows = confirm(ranked[:3], trial_runner, out_dir)                 # real trials of the best three
    print(format_confirmation(rows))
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import optuna

from policies import Policy
from tuner.search.design import screen_design
from tuner.measure.capacity import capacity_searcher
from tuner.search.objective import goodput
from tuner.search.trial_record import ROLE_SCREENED, TrialRecord, goodput_prediction, screened_attrs
from engine.knobs import short_knobs
from tuner.simulation.profiles import limits_of, profile_path
from tuner.simulation.simulator_trial import SimTrialRunner
from tuner.simulation.step_time_model import StepTimeModel
from tuner.trials.engine_handle import EngineError, EngineHandle
from tuner.trials.trial_backend import TrialBackend
from tuner.trials.trial_runner import TrialOutcome, TrialRunner

CONFIRMED = 3  # how many of the best screened configs the study confirms on the engine
# The capacity screen (screen_capacity). The simulator is cheap, so each of its probes is one sustained window of
# SCREEN_WINDOW_S simulated seconds (as the verdict measures) rather than the engine's windows from idle: at the
# engine's cap one draw's capacity of a config moved between 0 and 1.5 req/s from draw to draw in the simulator. The
# screen claims nothing, so its searches steer by what each window read (tuner/measure/capacity.py). The best
# SCREEN_REDRAWN configs on the first draw are searched on SCREEN_DRAWS draws in all and ranked by their worst: a
# config whose capacity holds on every draw, not the luckiest one on a single draw.
SCREEN_WINDOW_S = 90.0
SCREEN_DRAWS = 3
SCREEN_REDRAWN = 8
COMPARED = ("goodput_rps", "throughput_rps", "tbt_p99", "ttft_p99", "attainment")


@dataclass
class Screened:
    knobs: dict[str, Any]  # the searched (and fixed) knobs, constraints repaired
    outcome: TrialOutcome  # simulated
    params: dict[str, Any] = field(default_factory=dict)  # what the sampler drew (before repair), to enqueue

    @property
    def goodput(self) -> float:
        return goodput(self.outcome)


def sample_configs(policy: Policy, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Up to ``n`` distinct configs of the policy's search space: all of them when there are no more, else a
    space-filling design on ``seed`` (tuner/search/design.py)."""
    return [knobs for knobs, _ in screen_design(policy, n, seed)]


@dataclass
class ScreenedCapacity:
    """A config's capacity in the simulator on each arrival draw it was searched on."""

    knobs: dict[str, Any]
    params: dict[str, Any]  # what the sampler drew, to enqueue
    capacities: list[float] = field(default_factory=list)
    bounds: list[str] = field(default_factory=list)  # per draw, what ended the capacity (Capacity.bound)

    @property
    def bound(self) -> str:
        """``ttft`` or ``tbt`` when that target ended the capacity on most draws, else empty."""
        bound, n = Counter(self.bounds).most_common(1)[0] if self.bounds else ("", 0)
        return bound if 2 * n > len(self.bounds) else ""

    @property
    def worst(self) -> float:
        return min(self.capacities)

    @property
    def typical(self) -> float:
        """The median over the draws: what one draw, an engine search's, is expected to show."""
        return float(statistics.median(self.capacities))

    def rank_key(self) -> tuple[float, ...]:
        # more draws first (a config seen on one draw only is not known to hold), then the worst, then the mean
        return (-len(self.capacities), -self.worst, -statistics.fmean(self.capacities))


def screen_capacity(policy: Policy, sim: TrialBackend, n: int, out_dir: Path, draws: int = SCREEN_DRAWS,
                    redrawn: int = SCREEN_REDRAWN, window_s: float = SCREEN_WINDOW_S,
                    seed: int | None = None) -> list[ScreenedCapacity]:
    """The capacity of ``n`` configs of ``policy``'s space (tuner/search/design.py, on ``seed``, default the
    policy's) in the simulator ``sim``: all on one draw, the best ``redrawn`` of them on ``draws`` in all; best first
    (see :meth:`ScreenedCapacity.rank_key`). Each draw's searches learn their starts from each other
    (tuner.measure.capacity.CapacitySearcher), as the engine's do."""
    design = screen_design(policy, n, policy.seed if seed is None else seed)
    configs = [ScreenedCapacity(knobs, params) for knobs, params in design]

    def search(chosen: list[ScreenedCapacity], draw: int) -> None:
        searcher = capacity_searcher(sim, policy)
        searcher.spec = replace(searcher.spec, sustained_s=window_s)
        for i, c in enumerate(chosen):
            # probe j of a search is on draw base + j: bases max_probes apart keep the draws' arrivals apart
            cap = searcher.search(c.knobs, Path(out_dir) / f"draw-{draw}" / f"config-{i}",
                                  draw=draw * policy.capacity.max_probes)
            c.capacities.append(cap.value)
            c.bounds.append(cap.bound)

    with warnings.catch_warnings():
        warnings.simplefilter("default")  # once per location: a warning per input, not per config
        search(configs, 0)
        best = sorted(configs, key=lambda c: -c.capacities[0])[:redrawn]
        for draw in range(1, draws):
            search(best, draw)
    return sorted(configs, key=ScreenedCapacity.rank_key)


def rank(screened: list[Screened]) -> list[Screened]:
    """Feasible configs first, by goodput (highest first); then the infeasible ones, by goodput."""
    return sorted(screened, key=lambda s: (not s.outcome.feasible, -s.goodput))


def load_profile(profile: str | Path | None = None, dtype: str | None = None) -> StepTimeModel:
    """The step-time profile ``profile``, else $SLOTUNE_PROFILE, else the one shipped for ``dtype``."""
    return StepTimeModel.load(profile_path(str(profile) if profile else None, dtype))


def sim_runner_like(runner: TrialRunner, profile: str | Path | None = None,
                    measured: list[dict[str, Any]] | None = None, model: StepTimeModel | None = None
                    ) -> SimTrialRunner:
    """A simulated twin of a real TrialRunner: same workload, rate, window, SLO, seed and base config; step times
    from ``model``, else from ``profile`` (default: $SLOTUNE_PROFILE, else the shipped profile), rescaled to the
    engine's ``measured`` step records when there are enough of them (StepTimeModel.rescaled; the scale is in
    ``timer.meta``). The model limits are the engine's own where it answers (its dtype sets the KV bytes per
    token, so the twin's KV pool holds as many tokens), else the profile's."""
    model = model or load_profile(profile)
    model = (model.rescaled(measured) if measured else None) or model
    return SimTrialRunner(model, limits=limits_of(model, engine_admin_config(runner)), workload=runner.workload,
                          rate=runner.rate, duration=runner.duration, warmup=runner.warmup, slo=runner.slo,
                          seed=runner.seed, base_knobs=dict(runner.base_knobs or {}))


def _live_handle(runner: TrialRunner | SimTrialRunner) -> EngineHandle | None:
    if not isinstance(runner, TrialRunner):  # a simulated engine (tests): no engine to ask
        return None
    return runner.handle


def engine_admin_config(runner: TrialRunner | SimTrialRunner) -> dict[str, Any] | None:
    """GET /admin/config of the engine ``runner`` measures, None when there is none yet or it does not answer."""
    handle = _live_handle(runner)
    try:
        return handle.admin_config() if handle else None
    except EngineError:
        return None


def engine_dtype(runner: TrialRunner | SimTrialRunner) -> str | None:
    """The dtype the engine ``runner`` measures runs in (its /health), None when it does not answer."""
    handle = _live_handle(runner)
    health = handle.health() if handle else None
    return (health or {}).get("dtype")


def screen(policy: Policy, n: int, runner: SimTrialRunner | TrialRunner, seed: int = 0,
           progress: Callable[[int, int], None] | None = None, *, study: optuna.Study | None = None,
           out_dir: Path | None = None, top: int = CONFIRMED, profile: str | Path | None = None) -> list[Screened]:
    """Simulate ``n`` configs of ``policy``'s search space (tuner/search/design.py, on ``seed``); ranked (see
    :func:`rank`).

    ``runner`` is a SimTrialRunner, or the tuner's real TrialRunner (then its simulated twin, with ``profile``, runs
    the configs). With ``study``, the ``top`` best are enqueued into it (user attrs ``role: "screened"``,
    ``screen_rank``, ``screen_predicted``), so the study's next trials confirm them on the engine; with ``out_dir``,
    the ranking goes to ``out_dir/screen.json``. Extrapolation warnings of the step-time model come once per input
    for the whole screen, not once per config."""
    sim = runner if isinstance(runner, SimTrialRunner) else sim_runner_like(runner, profile)
    out: list[Screened] = []
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # once per location: a warning per input, not per config
        sampled = screen_design(policy, n, seed)
        for i, (knobs, params) in enumerate(sampled):
            out.append(Screened(knobs, sim.run(knobs), params))
            if progress is not None:
                progress(i + 1, len(sampled))
    ranked = rank(out)
    if study is not None:
        for i, s in enumerate(ranked[:top]):
            study.enqueue_trial(s.params, user_attrs=screened_attrs(i + 1, goodput_prediction(predicted(s.outcome))),
                                skip_if_exists=True)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "screen.json").write_text(json.dumps(
            [{"knobs": s.knobs, "feasible": s.outcome.feasible, "reason": s.outcome.reason,
              **predicted(s.outcome)} for s in ranked], indent=1) + "\n")
    return ranked


def predicted(outcome: TrialOutcome) -> dict[str, Any]:
    """The compared quantities of a (simulated) outcome."""
    summary = outcome.summary or {}
    return {k: summary.get(k) for k in COMPARED}


def screen_report(study: optuna.Study) -> str:
    """Predicted (simulated) against measured for every screened trial the study has run, as a table ("" when
    the study screened nothing)."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        record = TrialRecord.from_trial(t)
        if record.role != ROLE_SCREENED or record.summary is None:
            continue
        rows.append((record.screen_rank, record.knobs if record.knobs is not None else {},
                     record.screen_predicted or {}, record.summary or {}))
    return format_rows(rows) if rows else ""


@dataclass
class Confirmation:
    knobs: dict[str, Any]
    predicted: TrialOutcome
    measured: TrialOutcome

    def row(self) -> dict[str, Any]:
        p, m = self.predicted.summary or {}, self.measured.summary or {}
        return {"knobs": self.knobs, "predicted": {k: p.get(k) for k in COMPARED},
                "measured": {k: m.get(k) for k in COMPARED}, "predicted_feasible": self.predicted.feasible,
                "measured_feasible": self.measured.feasible, "measured_reason": self.measured.reason}


def confirm(best: list[Screened], runner: TrialRunner, out_dir: Path) -> list[Confirmation]:
    """Run each screened config as a real trial (tuner.trials.trial_runner.TrialRunner) into ``out_dir/confirm-N``."""
    return [Confirmation(s.knobs, s.outcome, runner.run(s.knobs, Path(out_dir) / f"confirm-{i}"))
            for i, s in enumerate(best)]


def format_confirmation(rows: list[Confirmation]) -> str:
    """Predicted against measured goodput, p99 TBT and p99 TTFT of each confirmed config, as a table."""
    return format_rows([(i + 1, c.knobs, predicted(c.predicted), predicted(c.measured)) for i, c in enumerate(rows)])


def format_rows(rows: list[tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any]]]) -> str:
    def ms(v: Any) -> str:
        return "-" if v is None else f"{v * 1000:.0f}ms"

    def rps(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = [f"{'#':>2} {'config':<56} {'goodput sim/real':>17} {'p99 TBT sim/real':>18} {'p99 TTFT sim/real':>19}"]
    for rank_, knobs, p, m in rows:
        cfg = short_knobs(knobs)[:56]
        lines.append(f"{rank_!s:>2} {cfg:<56} {rps(p.get('goodput_rps')) + ' / ' + rps(m.get('goodput_rps')):>17} "
                     f"{ms(p.get('tbt_p99')) + ' / ' + ms(m.get('tbt_p99')):>18} "
                     f"{ms(p.get('ttft_p99')) + ' / ' + ms(m.get('ttft_p99')):>19}")
    return "\n".join(lines)
