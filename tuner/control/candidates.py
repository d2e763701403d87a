"""A candidate for one move: the simulator's step-time model refitted on the engine's recent step records, the
workload rebuilt from the live shape, warm-started from the shared study's best configs, screened within the
guardrails, and compared with the applied config on the same simulated arrivals."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.config import LoadConfig
from slotune.slo import SLO
from policies import Policy, WorkloadSpec
from policies.control import REDRAW_LEVEL
from tuner.control.canary import sign_flip_p_value
from tuner.control.guardrails import changed, move_policy, project, within
from tuner.control.shape import Shape
from tuner.search.screening import COMPARED, load_profile, sample_configs
from tuner.simulation.profiles import limits_of
from tuner.simulation.simulator_trial import SimTrialRunner
from tuner.trials.trial_runner import TrialOutcome

LENGTH_SPREAD = 0.5  # without length histograms: lengths uniform within +-50 % of the live means
WEIGHT_UNITS = 100  # the rebuilt mix's weights add up to about this
MIN_GAIN = 0.05  # a candidate must beat the applied config's predicted goodput by this much (or its attainment)
GAP_ALLOWANCE = 1.5  # a request's own p99 gap lets its largest gaps exceed the TBT target: room for them
MIN_DRAIN_S = 10.0  # the simulated drain's floor and ceiling (seconds after the window's last arrival)
MAX_DRAIN_S = 300.0
LEADERS = 5  # screened predictions a retune logs beside its pick


@dataclass(frozen=True)
class Prediction:
    knobs: dict[str, Any]
    summary: dict[str, Any]

    def figure(self, key: str, missing: float = 0.0) -> float:
        """The summary's ``key`` as a float (``missing`` when absent or not finite: a rejected config's is empty)."""
        v = self.summary.get(key)
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else missing

    @property
    def attainment(self) -> float:
        return self.figure("attainment")

    @property
    def goodput(self) -> float:
        return self.figure("goodput_rps")

    @property
    def throughput(self) -> float:
        """Requests finished within the window per second, attaining or not, the queue's included (the
        simulated trial's ``served_rps``): behind a deep queue no config attains in a short simulated window and the
        window's own arrivals may not even start, and the one that finishes more drains the queue sooner."""
        return self.figure("served_rps")

    @property
    def ttft_p99(self) -> float:
        return self.figure("ttft_p99", math.inf)

    def as_dict(self) -> dict[str, Any]:
        return {"knobs": self.knobs, **{k: self.summary.get(k) for k in COMPARED}}


@dataclass(frozen=True)
class Search:
    """What one retune found: the best candidate (None: stay), the applied config's prediction, and why."""

    candidate: Prediction | None
    current: Prediction
    reason: str
    screened: int
    workload: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    redraws: dict[str, Any] = field(default_factory=dict)  # the pick's check on fresh draws (Redraws.as_dict)
    # the best LEADERS screened predictions, best first: what the pick was chosen from (a decision log reader's
    # view of the screen, where the pick alone does not say why nothing better was found)
    leaders: tuple[dict[str, Any], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate.as_dict() if self.candidate else None, "current": self.current.as_dict(),
                "reason": self.reason, "screened": self.screened, "workload": self.workload, "model": self.model,
                "redraws": self.redraws, "leaders": list(self.leaders)}


def live_workload(shape: Shape) -> WorkloadSpec:
    """The live traffic as a mixed workload. With the engine's length histograms: one class per pair of a prompt
    bucket and an output bucket that finished requests fell in, its lengths uniform within the buckets and its
    weight the product of the two buckets' counts (the histograms are marginals: prompt and output lengths are
    taken as independent). Without them (a source that only counts tokens): one class within +-50 % of the means."""
    prompts, outputs = shape.prompt_lengths.ranges(), shape.output_lengths.ranges()
    if prompts and outputs:
        total = sum(pc for _, _, pc in prompts) * sum(oc for _, _, oc in outputs)
        # weights in percent of the traffic (the mixed workload deals each block of sum(weights) requests exactly);
        # a pair under half a percent is left out
        classes = [(f"p{i}o{j}", f"{pl}-{ph}:{ol}-{oh}", round(WEIGHT_UNITS * pc * oc / total))
                   for i, (pl, ph, pc) in enumerate(prompts) for j, (ol, oh, oc) in enumerate(outputs)]
        classes = [c for c in classes if c[2] > 0] or [max(classes, key=lambda c: c[2])[:2] + (1,)]
        return WorkloadSpec(name="mixed", length_scale=1.0, mix=",".join(f"{n}={spec}" for n, spec, _ in classes),
                            mix_weights=":".join(str(w) for _, _, w in classes))

    def span(mean: float) -> str:
        m = max(1.0, mean if math.isfinite(mean) else 1.0)
        return f"{max(1, round(m * (1 - LENGTH_SPREAD)))}-{max(1, round(m * (1 + LENGTH_SPREAD)))}"

    return WorkloadSpec(name="mixed", length_scale=1.0, mix=f"live={span(shape.mean_prompt)}:{span(shape.mean_output)}",
                        mix_weights="1")


def longest_output(shape: Shape) -> float:
    """The longest output the rebuilt workload (:func:`live_workload`) can draw."""
    outputs = shape.output_lengths.ranges()
    if outputs:
        return float(max(high for _, high, _ in outputs))
    mean = shape.mean_output
    return max(1.0, mean if math.isfinite(mean) else 1.0) * (1 + LENGTH_SPREAD)


def judging_drain(slo: SLO, longest_output: float, request_timeout: float = LoadConfig.request_timeout) -> float:
    """How long the simulation lets the window's requests finish after its last arrival: as long as the longest
    output could take and still meet the SLO (its e2e target, else its TTFT target, or the client's timeout
    without one, and then the TBT target per token), so that a request left unfinished could not have attained.
    A fixed short drain fails every long request on a slow machine and no config could look feasible."""
    if slo.e2e_p99 is not None:
        bound = slo.e2e_p99
    elif slo.tbt_p99 is not None:
        ttft = slo.ttft_p99 if slo.ttft_p99 is not None else request_timeout
        bound = ttft + GAP_ALLOWANCE * slo.tbt_p99 * longest_output
    else:
        bound = request_timeout
    return min(MAX_DRAIN_S, max(MIN_DRAIN_S, bound))


def refitted_model(steps: list[dict[str, Any]], block_size: int, profile: str | Path | None,
                   dtype: str | None = None) -> Any:
    """The given step-time profile (else the one shipped for the engine's ``dtype``) rescaled to the engine's recent
    step records (unchanged when there are too few of them)."""
    model = load_profile(profile, dtype)
    tagged = [{**s, "block_size": block_size} for s in steps]
    return model.rescaled(tagged, block_size) or model


def deciding_figure(best: Prediction, now: Prediction, target: float) -> str | None:
    """The figure by which ``best`` beats ``now`` (None: it does not): attainment reaching the target where the
    applied config's does not, goodput by MIN_GAIN, or, behind a queue no config attains in the simulated window,
    finishing more (it drains the queue sooner)."""
    if best.attainment >= target > now.attainment:
        return "attainment"
    if best.attainment >= min(target, now.attainment) and best.goodput > now.goodput * (1 + MIN_GAIN):
        return "goodput_rps"
    if best.goodput <= now.goodput * (1 + MIN_GAIN) and now.attainment < target \
            and best.throughput > now.throughput * (1 + MIN_GAIN) and best.goodput >= now.goodput:
        return "served_rps"
    return None


def mean_prediction(knobs: dict[str, Any], draws: list[Prediction]) -> Prediction:
    """The draws' mean of each figure the comparison reads."""
    keys = {k for p in draws for k, v in p.summary.items() if isinstance(v, (int, float))}
    return Prediction(knobs, {k: float(np.mean([p.figure(k, math.nan) for p in draws])) for k in keys})


@dataclass(frozen=True)
class Redraws:
    """The pick against the applied config on fresh common arrivals: each draw's difference of the deciding figure,
    and the one-sided sign-flip test of their mean at REDRAW_LEVEL (the canary's test: exact whatever the
    differences' shape, which is far from normal; where both configs attain every request of a draw it adds a 0)."""

    figure: str | None
    differences: tuple[float, ...]

    def finite(self) -> list[float]:
        return [x for x in self.differences if math.isfinite(x)]

    @property
    def p_value(self) -> float:
        return sign_flip_p_value(self.finite()) if self.figure is not None else 1.0

    @property
    def holds(self) -> bool:
        return self.p_value <= REDRAW_LEVEL

    def as_dict(self) -> dict[str, Any]:
        d = self.finite()
        return {"figure": self.figure, "differences": [round(x, 4) for x in self.differences],
                "mean": round(float(np.mean(d)), 4) if d else None, "p_value": round(self.p_value, 4),
                "holds": self.holds}


def remembered(move: dict[str, Any], current: dict[str, Any], rolled_back: list[dict[str, Any]]) -> bool:
    """The same move from the same values was canaried and rolled back (since the workload last drifted)."""
    return any(r["to"] == move and all(current.get(k) == v for k, v in r["from"].items()) for r in rolled_back)


def _ranked(p: Prediction, target: float) -> tuple[bool, float, float, float, float]:
    # last, of configs that all serve the simulated load: the lowest p99 TTFT, the one with the most room to spare
    # (the step-time model is refitted on the applied config's steps: a config only just predicted to keep up
    # often does not)
    return (p.attainment >= target, p.goodput, p.throughput, p.attainment, -p.ttft_p99)


def search(policy: Policy, current: dict[str, Any], resolved: dict[str, Any], shape: Shape,
           steps: list[dict[str, Any]], study_knobs: list[dict[str, Any]], *, target: float,
           profile: str | Path | None = None, seed: int = 0, backlog: int = 0,
           admin_config: dict[str, Any] | None = None, dtype: str | None = None,
           rolled_back: list[dict[str, Any]] | None = None) -> Search:
    """Screen one move's candidates at the live rate times the policy's headroom, starting from the engine's live
    queue (``backlog`` requests waiting or running: a config that only keeps up once the queue is empty would
    otherwise look fine); the best one if it beats the applied config's prediction (attainment reaching the target
    where the applied one's does not, or goodput by MIN_GAIN). ``admin_config`` (GET /admin/config) and ``dtype``
    are the engine's: its model limits and the shipped profile of its dtype. The pick was chosen for its one draw
    (the best of many noisy draws is biased up): it moves only when ``retune.draws`` fresh draws of it and the
    applied config, on common arrivals, confirm its edge beyond their spread. A move in ``rolled_back`` is not
    screened again."""
    retune = policy.control.retune
    model = refitted_model(steps, int(resolved.get("block_size") or 16), profile, dtype)
    workload = live_workload(shape)
    rate = max(0.05, shape.arrival_rate * retune.headroom)
    drain = judging_drain(policy.slo, longest_output(shape))
    sim = SimTrialRunner(model, limits=limits_of(model, admin_config), workload=workload, rate=rate,
                         duration=retune.sim_duration, warmup=3.0, slo=policy.slo, seed=seed, base_knobs=dict(current),
                         backlog=backlog, drain_timeout=drain)
    info: dict[str, Any] = {"workload": {**workload.as_dict(), "rate": round(rate, 4), "backlog": backlog,
                                         "drain_s": drain},
            "model": {"rescaled": model.meta.get("rescaled"), "steps": len(steps)}}

    def predict(knobs: dict[str, Any]) -> Prediction:
        outcome: TrialOutcome = sim.run(knobs)
        return Prediction(knobs, outcome.summary or {})

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # extrapolation warnings: the live shape may leave the profiled range
        now = predict({})
        try:
            moved = move_policy(policy, current, resolved)
        except ValueError as error:
            return Search(None, Prediction(dict(current), now.summary), str(error), 0, **info)
        # the study's best configs (measured on an engine) first: on a tie the first one screened wins
        pool = [project(k, moved) for k in study_knobs] + sample_configs(moved, retune.candidates, seed)
        seen, preds = set(), []
        for knobs in pool:
            key = repr(sorted(knobs.items()))
            if key in seen or not changed(knobs, current) or within(knobs, current, policy) is not None \
                    or remembered(changed(knobs, current), current, rolled_back or []):
                continue
            seen.add(key)
            preds.append(predict(knobs))
    now = Prediction(dict(current), now.summary)
    if not preds:
        return Search(None, now, "no candidate within the guardrails differs from the applied config", 0, **info)
    ranked = sorted(preds, key=lambda p: _ranked(p, target), reverse=True)
    best = ranked[0]
    info = {**info, "leaders": tuple(p.as_dict() for p in ranked[:LEADERS])}
    if deciding_figure(best, now, target) is None:
        return Search(None, now, f"no candidate is predicted to beat the applied config (best: attainment "
                                 f"{best.attainment:.0%}, goodput {best.goodput:.2f} rps; applied: "
                                 f"{now.attainment:.0%}, {now.goodput:.2f} rps)", len(preds), **info)
    return confirmed(sim, best, now, target, seed, retune.draws, len(preds), info)


def confirmed(sim: SimTrialRunner, best: Prediction, now: Prediction, target: float, seed: int, draws: int,
              screened: int, info: dict[str, Any]) -> Search:
    """``best`` against the applied config on ``draws`` fresh common arrival draws: the move only when its edge
    holds there beyond the draws' spread."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh = [(Prediction(best.knobs, dataclasses.replace(sim, seed=s).run(best.knobs).summary or {}),
                  Prediction(now.knobs, dataclasses.replace(sim, seed=s).run({}).summary or {}))
                 for s in range(seed * 1000 + 1, seed * 1000 + 1 + draws)]
    pick, applied = mean_prediction(best.knobs, [f[0] for f in fresh]), mean_prediction(now.knobs, [f[1] for f in fresh])
    figure = deciding_figure(pick, applied, target)
    redraws = Redraws(figure, tuple(b.figure(figure, math.nan) - a.figure(figure, math.nan) for b, a in fresh)
                      if figure else ())
    info = {**info, "redraws": redraws.as_dict()}
    if not redraws.holds:
        return Search(None, now, f"the pick's edge did not hold on {draws} fresh draws (attainment "
                                 f"{applied.attainment:.0%} -> {pick.attainment:.0%}, goodput {applied.goodput:.2f} "
                                 f"-> {pick.goodput:.2f} rps)", screened, **info)
    backlog = info["workload"]["backlog"]
    return Search(pick, applied, f"predicted over {draws} fresh draws: attainment {applied.attainment:.0%} -> "
                                 f"{pick.attainment:.0%}, goodput {applied.goodput:.2f} -> {pick.goodput:.2f} rps, "
                                 f"finishing {applied.throughput:.2f} -> {pick.throughput:.2f} req/s at "
                                 f"{sim.rate:.2f} req/s" + (f" behind a queue of {backlog}" if backlog else ""),
                  screened, **info)
