"""Screening: simulate many configs from a policy's search space, rank them by simulated goodput under the SLO,
and confirm the best few on the engine (predicted against measured, side by side).

    ranked = screen(policy, 1000, SimTrialRunner(model, ...))        # seconds to minutes
    rows = confirm(ranked[:3], trial_runner, out_dir)                 # real trials of the best three
    print(format_confirmation(rows))
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import optuna

from loadtest.summary import SLO
from policies import Policy
from tuner.search.objective import goodput, suggest_knobs
from tuner.output import short_knobs
from tuner.simulation.simulator_trial import SimTrialRunner
from tuner.simulation.step_time_model import StepTimeModel
from tuner.trials.engine_handle import EngineError, EngineHandle, ManagedEngine
from tuner.trials.trial_backend import TrialBackend
from tuner.trials.trial_runner import TrialOutcome, TrialRunner

CONFIRMED = 3  # how many of the best screened configs the study confirms on the engine
# The screen is ranked again when the engine's speed (the profile's scale) moved by more than this share since the
# ranking was made: a smaller change reorders nothing beyond the simulator's own step-to-step noise.
RESCREEN_TOLERANCE = 0.02
# The capacity screen (screen_capacity). The simulator is cheap, so its measurements are sized to decide (up to
# SCREEN_CAP_S simulated seconds each) rather than to the engine's cap: at the engine's cap one draw's capacity of a
# config moved between 0 and 1.5 req/s from draw to draw in the simulator. The best SCREEN_REDRAWN configs on the
# first draw are searched on SCREEN_DRAWS draws in all and ranked by their worst: a config whose capacity holds on
# every draw, not the luckiest one on a single draw.
SCREEN_CAP_S = 300.0
# After a searched config whose capacity the TTFT target ended (queueing at few sequences), the next screened trial
# is the best config among the first HEDGE_WITHIN of the ranking that the TTFT target alone does not end, and the
# same for TBT:
# the simulator's error near one target (a TTFT edge, a step time near the TBT target) then does not decide alone
# which kind of config the engine measures (in two runs an hour apart the screen's first pick changed kind).
HEDGE_WITHIN = 8
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
    """Up to ``n`` distinct configs drawn uniformly (log-uniformly where the policy says log) from the policy's
    search space, by the tuner's own sampling code (tuner.search.objective.suggest_knobs) under Optuna's random sampler."""
    return [knobs for knobs, _ in _sample(policy, n, seed)]


def _sample(policy: Policy, n: int, seed: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    seen: set[str] = set()
    out: list[tuple[dict[str, Any], dict[str, Any]]] = []
    misses = 0
    while len(out) < n and misses < 500:  # 500 repeats in a row: a small space is exhausted
        trial = study.ask()
        knobs = suggest_knobs(trial, policy)
        key = json.dumps(knobs, sort_keys=True)
        if key in seen:
            misses += 1
            continue
        misses = 0
        seen.add(key)
        out.append((knobs, dict(trial.params)))
    return out


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
        common = statistics.multimode(self.bounds) if self.bounds else [""]
        return common[0] if len(common) == 1 and 2 * self.bounds.count(common[0]) > len(self.bounds) else ""

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
                    redrawn: int = SCREEN_REDRAWN, cap_s: float = SCREEN_CAP_S) -> list[ScreenedCapacity]:
    """The capacity of ``n`` configs sampled from ``policy``'s space in the simulator ``sim``: all on one draw, the
    best ``redrawn`` of them on ``draws`` in all; best first (see :meth:`ScreenedCapacity.rank_key`). Each draw's
    searches learn their starts from each other (tuner.measure.capacity.CapacitySearcher), as the engine's do."""
    from tuner.measure.capacity import capacity_searcher

    sized = policy.replace(measurement=replace(policy.measurement, cap=cap_s))
    configs = [ScreenedCapacity(knobs, params) for knobs, params in _sample(policy, n, policy.seed)]

    def search(chosen: list[ScreenedCapacity], draw: int) -> None:
        searcher = capacity_searcher(sim, sized)
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
    from tuner.simulation.simulator import profile_path

    return StepTimeModel.load(profile_path(str(profile) if profile else None, dtype))


def sim_runner_like(runner: TrialRunner, profile: str | Path | None = None,
                    measured: list[dict[str, Any]] | None = None, model: StepTimeModel | None = None
                    ) -> SimTrialRunner:
    """A simulated twin of a real TrialRunner: same workload, rate, window, SLO, seed and base config; step times
    from ``model``, else from ``profile`` (default: $SLOTUNE_PROFILE, else the shipped profile), rescaled to the
    engine's ``measured`` step records when there are enough of them (StepTimeModel.rescaled; the scale is in
    ``timer.meta``). The model limits are the engine's own where it answers (its dtype sets the KV bytes per
    token, so the twin's KV pool holds as many tokens), else the profile's."""
    from tuner.simulation.simulator import limits_of

    model = model or load_profile(profile)
    model = (model.rescaled(measured) if measured else None) or model
    assert isinstance(runner.slo, SLO)  # TrialRunner.__post_init__ made it one
    return SimTrialRunner(model, limits=limits_of(model, engine_admin_config(runner)), workload=runner.workload,
                          rate=runner.rate, duration=runner.duration, warmup=runner.warmup, slo=runner.slo,
                          seed=runner.seed, base_knobs=dict(runner.base_knobs or {}))


def _live_handle(runner: TrialRunner | SimTrialRunner) -> EngineHandle | None:
    if not isinstance(runner, TrialRunner):  # a simulated engine (tests): no engine to ask
        return None
    engine = runner.engine
    return engine.handle if isinstance(engine, ManagedEngine) else engine


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


def measured_steps(study: optuna.Study) -> list[dict[str, Any]]:
    """The engine's step records of the study's completed real trials (the steps.jsonl of every window under the
    trial's folder, all of a capacity trial's probes included), each with its trial's block size."""
    out: list[dict[str, Any]] = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        block_size = (t.user_attrs.get("knobs") or {}).get("block_size")
        folder = t.user_attrs.get("steps_dir") or t.user_attrs.get("trial_dir")
        if t.user_attrs.get("simulated") or not folder or block_size is None:
            continue
        for path in sorted(Path(folder).rglob("steps.jsonl")):
            out += [{**json.loads(line), "block_size": block_size} for line in path.read_text().splitlines()
                    if line.strip()]
    return out


def speed_scale(model: StepTimeModel | None) -> float:
    """The factor ``model``'s step times were rescaled by to the engine's (1.0: the profile as calibrated): the
    geometric mean of its decode and prefill factors, one number whose move triggers a new ranking."""
    r = (model.meta if model is not None else {}).get("rescaled") or {}
    decode = float(r.get("scale", 1.0))
    return math.sqrt(decode * float(r.get("prefill_scale", decode)))


def rescale_text(model: StepTimeModel | None) -> str:
    """``decode steps x0.54, prefill steps x0.59-0.91 (16-256 tokens) (rescaled to 786 engine steps)``; empty when
    not rescaled."""
    r = (model.meta if model is not None else {}).get("rescaled")
    if model is None or not r:
        return ""
    prefill = f"x{r.get('prefill_scale', r['scale']):.2f}"
    if model.prefill_exponent:
        lo, hi = model.prefill_tokens
        prefill = (f"x{model.prefill_factor_at(int(lo)) * r['scale']:.2f}-{model.prefill_factor_at(int(hi)) * r['scale']:.2f}"
                   f" ({lo:.0f}-{hi:.0f} tokens)")
    return f"decode steps x{r['scale']:.2f}, prefill steps {prefill} (rescaled to {r['steps']} engine steps)"


# A screened config as the study enqueues it: the sampler's params, and the prediction kept in its user attrs.
Candidate = tuple[dict[str, Any], dict[str, Any]]


@dataclass
class Rescreen:
    """The screen kept at the engine's present speed, one screened trial at a time.

    Before each screened trial the calibrated ``profile`` is rescaled to the step records of all the study's real
    trials so far (:func:`measured_steps`, StepTimeModel.rescaled: one speed factor, the median measured/predicted
    ratio of the pooled steps, so each trial adds its steps to the estimate rather than replacing it), and when that
    factor moved by more than ``tolerance`` since the ranking was made, ``rank`` ranks the screened configs again on
    the rescaled model. The next screened trial is the best config of the latest ranking that the study has not run;
    ``top`` screened trials in all. ``profile`` None: a simulated engine, whose model needs no rescaling (ranked
    once, with ``rank(None)``).

    ``rank(model)`` simulates the screened configs with ``model``'s step times and returns them best first."""

    profile: StepTimeModel | None
    rank: Callable[[StepTimeModel | None], list[Candidate]]
    top: int = CONFIRMED
    tolerance: float = RESCREEN_TOLERANCE
    model: StepTimeModel | None = None  # the model of the latest ranking
    ranking: list[Candidate] = field(default_factory=list)
    rankings: int = 0  # how many times it ranked

    @property
    def scale(self) -> float:
        """The speed factor of the latest ranking."""
        return speed_scale(self.model)

    def fitted(self, study: optuna.Study) -> StepTimeModel | None:
        """The profile rescaled to the step records of all the study's real trials (the profile itself while they
        are too few)."""
        if self.profile is None:
            return None
        steps = measured_steps(study)
        return (self.profile.rescaled(steps) if steps else None) or self.profile

    def refit(self, study: optuna.Study) -> bool:
        """Rescale to the study's real trials so far; rank again when the speed moved beyond the tolerance (or
        nothing was ranked yet). True when it ranked."""
        model = self.fitted(study)
        if self.rankings and abs(speed_scale(model) / self.scale - 1.0) <= self.tolerance:
            return False
        self.model, self.ranking = model, self.rank(model)
        self.rankings += 1
        return True

    def due(self, study: optuna.Study) -> bool:
        """Whether the study's next trial is a screened one: nothing waits in its queue and fewer than ``top``
        screened trials were run, or are running."""
        trials = study.get_trials(deepcopy=False)
        if any(t.state == optuna.trial.TrialState.WAITING for t in trials):
            return False
        return sum(t.user_attrs.get("role") == "screened" and t.state in _LIVE for t in trials) < self.top

    def enqueue_next(self, study: optuna.Study) -> Candidate | None:
        """When a screened trial is :meth:`due`: refit, and enqueue the best config of the ranking that the study
        has not tried (user attrs ``role: "screened"``, ``screen_rank``, ``screen_scale`` and the prediction).
        Returns what it enqueued (None: nothing)."""
        if not self.due(study):
            return None
        self.refit(study)
        live = study.get_trials(deepcopy=False, states=_LIVE)
        tried = {_key(t.params) for t in live}
        untried = [(i, c) for i, c in enumerate(self.ranking) if _key(c[0]) not in tried]
        # a hedge against the simulator's error in one latency: when every config searched so far was bound by one
        # target, the best config (of those ranked near the top) that it does not bound
        bounds = {t.user_attrs.get("screen_bound") or "" for t in live if t.user_attrs.get("role") == "screened"}
        other = [(i, c) for i, c in untried[:HEDGE_WITHIN]
                 if len(bounds) == 1 and "" not in bounds and (c[1].get("screen_bound") or "") not in bounds]
        for i, (params, prediction) in (other or untried)[:1]:
            study.enqueue_trial(params, user_attrs={"role": "screened", "screen_rank": i + 1,
                                                    "screen_scale": self.scale, **prediction})
            return params, prediction
        return None


_LIVE = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING)  # a failed trial may run again


def _key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def screen(policy: Policy, n: int, runner: SimTrialRunner | TrialRunner, seed: int = 0,
           progress: Callable[[int, int], None] | None = None, *, study: optuna.Study | None = None,
           out_dir: Path | None = None, top: int = CONFIRMED, profile: str | Path | None = None) -> list[Screened]:
    """Simulate ``n`` configs sampled from ``policy``'s search space; ranked (see :func:`rank`).

    ``runner`` is a SimTrialRunner, or the tuner's real TrialRunner (then its simulated twin, with ``profile``, runs
    the configs). With ``study``, the ``top`` best are enqueued into it (user attrs ``role: "screened"``,
    ``screen_rank``, ``screen_predicted``), so the study's next trials confirm them on the engine; with ``out_dir``,
    the ranking goes to ``out_dir/screen.json``. Extrapolation warnings of the step-time model come once per input
    for the whole screen, not once per config."""
    sim = runner if isinstance(runner, SimTrialRunner) else sim_runner_like(runner, profile)
    out: list[Screened] = []
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # once per location: a warning per input, not per config
        sampled = _sample(policy, n, seed)
        for i, (knobs, params) in enumerate(sampled):
            out.append(Screened(knobs, sim.run(knobs), params))
            if progress is not None:
                progress(i + 1, len(sampled))
    ranked = rank(out)
    if study is not None:
        for i, s in enumerate(ranked[:top]):
            study.enqueue_trial(s.params, user_attrs={"role": "screened", "screen_rank": i + 1,
                                                      "screen_predicted": predicted(s.outcome)},
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
        if t.user_attrs.get("role") != "screened" or "summary" not in t.user_attrs:
            continue
        p, m = t.user_attrs.get("screen_predicted") or {}, t.user_attrs.get("summary") or {}
        rows.append((t.user_attrs.get("screen_rank"), t.user_attrs.get("knobs", {}), p, m))
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
