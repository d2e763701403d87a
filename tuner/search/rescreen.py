"""The screen kept at the engine's present speed while a study runs: the shipped step-time profile rescaled to the
real trials' step records, the screened configs ranked again when that speed moves, and the next screened trial
chosen from the latest ranking (tuner/search/screening.py screens; this module keeps the screen current)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import optuna

from tuner.search.screening import CONFIRMED
from tuner.search.trial_record import ROLE_SCREENED, TrialRecord, screened_attrs
from tuner.simulation.step_time_model import StepTimeModel
from slotune import result_files as files

# The screen is ranked again when the engine's speed (the profile's scale) moved by more than this share since the
# ranking was made: a smaller change reorders nothing beyond the simulator's own step-to-step noise.
RESCREEN_TOLERANCE = 0.02
# After a searched config whose capacity the TTFT target ended (queueing at few sequences), the next screened trial
# is the best config among the first HEDGE_WITHIN of the ranking that the TTFT target alone does not end, and the
# same for TBT:
# the simulator's error near one target (a TTFT edge, a step time near the TBT target) then does not decide alone
# which kind of config the engine measures (in two runs an hour apart the screen's first pick changed kind).
HEDGE_WITHIN = 8


def measured_steps(study: optuna.Study) -> list[dict[str, Any]]:
    """The engine's step records of the study's completed real trials (the steps.jsonl of every window under the
    trial's folder, all of a capacity trial's probes included), each with its trial's block size."""
    out: list[dict[str, Any]] = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        record = TrialRecord.from_trial(t)
        block_size = (record.knobs or {}).get("block_size")
        folder = record.steps_dir or record.trial_dir
        if record.simulated or not folder or block_size is None:
            continue
        for path in sorted(Path(folder).rglob(files.STEPS)):
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
    # the simulator's error allowance on a capacity (None: every ranked config may be searched, in rank order)
    margin: float | None = None
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

    def allowance(self, params: dict[str, Any]) -> float:
        """The step-time model's error on the steps a config can run, as the latest ranking's rescale measured it:
        the worse of its decode batches (up to its ``max_num_seqs``) and its prefill steps (up to its
        ``max_num_batched_tokens``, else its ``chunk_size``), any measured bin where the knob is not searched; 0
        before a rescale."""
        if self.model is None:
            return 0.0
        seqs = params.get("max_num_seqs")
        tokens = params.get("max_num_batched_tokens", params.get("chunk_size"))
        return max(self.model.batch_error(int(seqs) if seqs is not None else None) or 0.0,
                   self.model.prefill_error(int(tokens) if tokens is not None else None) or 0.0)

    def contenders(self) -> list[int]:
        """The ranked configs the simulator cannot tell from the best: those whose best draw, raised by ``margin``
        and by the step-time model's error at both configs' batch sizes (:meth:`allowance`), reaches the best
        config's worst draw (indices into the ranking, best first). Only these are worth the engine's time: one
        clearly ahead leaves one, a flat top leaves several, and a model that is wrong where they run leaves more.
        All of them without a margin or without the draws' capacities (the goodput screen)."""
        caps = [TrialRecord.from_attrs(c[1]).screen_capacities or [] for c in self.ranking]
        if self.margin is None or not caps or not caps[0]:
            return list(range(len(self.ranking)))
        leader, leader_error = min(caps[0]), self.allowance(self.ranking[0][0])
        return [i for i, c in enumerate(caps)
                if c and max(c) * (1 + self.margin + leader_error + self.allowance(self.ranking[i][0])) >= leader]

    def largest_allowance(self) -> float:
        """The largest :meth:`allowance` among the latest ranking's configs."""
        return max((self.allowance(c[0]) for c in self.ranking), default=0.0)

    def untried_contenders(self, study: optuna.Study) -> int:
        """How many :meth:`contenders` of the latest ranking the study has not searched."""
        tried = {_key(t.params) for t in study.get_trials(deepcopy=False, states=_LIVE)}
        return sum(_key(self.ranking[i][0]) not in tried for i in self.contenders())

    def due(self, study: optuna.Study) -> bool:
        """Whether the study's next trial is a screened one: nothing waits in its queue and fewer than ``top``
        screened trials were run, or are running."""
        trials = study.get_trials(deepcopy=False)
        if any(t.state == optuna.trial.TrialState.WAITING for t in trials):
            return False
        return sum(TrialRecord.from_trial(t).role == ROLE_SCREENED and t.state in _LIVE for t in trials) < self.top

    def enqueue_next(self, study: optuna.Study) -> Candidate | None:
        """When a screened trial is :meth:`due`: refit, and enqueue the best config of the ranking that the study
        has not tried, among the :meth:`contenders` (user attrs ``role: "screened"``, ``screen_rank``,
        ``screen_scale`` and the prediction). Returns what it enqueued (None: nothing, also when every contender
        was searched)."""
        if not self.due(study):
            return None
        self.refit(study)
        live = study.get_trials(deepcopy=False, states=_LIVE)
        tried = {_key(t.params) for t in live}
        untried = [(i, c) for i, c in enumerate(self.ranking) if _key(c[0]) not in tried]
        near = set(self.contenders())
        best = [(i, c) for i, c in untried if i in near]
        # a hedge against the simulator's error in one latency: when every config searched so far was bound by one
        # target, the best config (of those ranked near the top) that it does not bound
        records = [TrialRecord.from_trial(t) for t in live]
        bounds = {r.screen_bound or "" for r in records if r.role == ROLE_SCREENED}
        other = [(i, c) for i, c in untried[:HEDGE_WITHIN] if len(bounds) == 1 and "" not in bounds
                 and (TrialRecord.from_attrs(c[1]).screen_bound or "") not in bounds]
        for i, (params, prediction) in (other or best)[:1]:
            study.enqueue_trial(params, user_attrs=screened_attrs(i + 1, prediction, scale=self.scale))
            return params, prediction
        return None


_LIVE = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING)  # a failed trial may run again


def _key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)
