"""``tune`` with the capacity objective (the default): the machine's floor, the default config's capacity, the
simulator's screen of the search space (its step times rescaled to the engine's own steps), the engine's capacity
searches of the configs that matter (the study's trials), the paired verdict, and the outputs.

A config written as tuned has held: the verdict showed it to serve a rate at or above one where the default was
shown to miss (tuner/measure/verdict.py). When no candidate did, tuned.yaml holds the safest config (the highest
rate shown served on the verdict's draws, the default on ties; where nothing was shown served, the candidate shown
to attain more than the default on the same arrivals) and says that nothing was shown to serve more.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import optuna

from slotune import result_files as files
from slotune.units import format_duration
from tuner.commands.nearest_run import floor_stop, none_shown
from tuner.commands.progress import PROG, LiveLine, probe_line, say
from tuner.commands.run_context import RunContext
from tuner.measure.capacity import MIN_RATE, CapacitySearcher, Shown, capacity_searcher, measurement_spec
from tuner.measure.floor import measure_floor
from engine.knobs import short_knobs
from tuner.output import write_report, write_tuned_yaml, write_vllm
from tuner.simulation.simulator_trial import SimTrialRunner
from tuner.search.design import design_words
from tuner.search.confirmation import confirmed_rows, error_words, simulator_error
from tuner.search.rescreen import Rescreen, rescale_text, speed_scale
from tuner.search.screening import (SCREEN_DRAWS, SCREEN_REDRAWN, engine_dtype, load_profile, screen_capacity,
                                    sim_runner_like)
from tuner.search.study import ROLE_DEFAULT, TrialReport, longest_trial_s, measured, run_trials, starts_in_time
from tuner.search.trial_record import TrialRecord, capacity_prediction, simulator_vs_engine_attrs, stamp
from tuner.trials import arrangement
from tuner.trials.engine_handle import ConfigRejected, EngineError
from tuner.trials.trial_runner import TrialRunner
from tuner.measure.verdict import DEFAULT, Contender, Sample, VerdictResult, pool_levels
from tuner.measure.verdict_report import capacity_section, verdict_line
from tuner.measure.verdict_rounds import first_rate, paired_verdict
from tuner.measure.verdict_plan import VerdictPlan, sample_of

if TYPE_CHECKING:
    from tuner.simulation.step_time_model import StepTimeModel

SCREENED = 40  # configs the simulator screens for capacity when --screen is not given


class CapacityRun:
    def __init__(self, context: RunContext, runner: TrialRunner | SimTrialRunner, study: optuna.Study,
                 model: str | None) -> None:
        self.s = context
        self.p = context.policy
        self.runner = runner
        self.study = study
        self.model = model
        self.searcher: CapacitySearcher = capacity_searcher(runner, self.p)
        self.searcher.on_probe = probe_line
        self.searcher.draw = context.draws.search
        self.plan = VerdictPlan.of(self.p)
        self.floor: dict[str, Any] = {}
        self.rescreen: Rescreen | None = None  # the screen kept at the engine's speed
        if isinstance(runner, TrialRunner):  # on a terminal: a live line while the load runs
            runner.on_progress = LiveLine([k.name for k in self.p.search_space], context.started + self.p.time_budget,
                                          path=context.trials_dir / files.PROGRESS)

    def run(self) -> int:
        p = self.p
        say(f"{PROG}: measuring this machine's floor (batch 1 under each arrangement of the load generator, then "
            f"batch 4) ...")
        floor, _ = measure_floor(self.runner, self.s.trials_dir / "floor", spec=measurement_spec(p),
                                 arrangements=arrangement.candidates(self.runner),
                                 arrange=lambda a: arrangement.apply(self.runner, a), draw=self.s.draws.floor)
        self.floor = floor.as_dict()
        say(f"{PROG}: floor: {floor.describe()}")
        slo = p.slo
        if floor.alone is not None:
            say(f"{PROG}: floor: {floor.alone.describe()}")
        if floor.reason is not None or floor.below(slo):
            code = floor_stop(self.s, self.runner, floor.reason or floor.why_below(slo),
                              floor.alone.targets if floor.alone is not None and floor.reason is None else None,
                              floor.rate)
            say(f"{PROG}: stopped after {format_duration(time.monotonic() - self.s.started)}" + self.restarts_text())
            return code
        say(f"{PROG}: study {self.s.study_name!r}: capacity (highest rate with >= 90% of requests within "
            f"{self.s.slo_text()}) of {p.trials} configs, the default included; windows of "
            f"{format_duration(p.trial_duration)} until decided (at most {format_duration(p.measurement.cap)}), "
            f"{p.measurement.level:.0%} intervals")
        run_trials(self.study, self.runner, p, p.trials, self.s.trials_dir, on_trial=self.trial_line,
                   searcher=self.searcher, max_runs=1)  # the default config: enqueued first
        self.screen()
        if len(measured(self.study)) < 2:
            # one screened candidate at least, whatever the clock says: a study of the default config alone cannot
            # answer the question, and the default's search (often at low rates, in long windows) says little about
            # how long a candidate's takes (started at its predicted capacity, its windows fill faster)
            run_trials(self.study, self.runner, p, p.trials, self.s.trials_dir, on_trial=self.after_trial,
                       searcher=self.searcher, max_runs=1)
        # the further searches stop probing at the deadline too: a search that started in time cannot run into the
        # verdict's rounds
        self.searcher.deadline = self.searches_deadline()
        while self.rescreen is None or self.waiting():  # screened: while a contender waits (after_trial enqueues)
            ran = run_trials(self.study, self.runner, p, p.trials, self.s.trials_dir, on_trial=self.after_trial,
                             searcher=self.searcher, deadline=self.searcher.deadline,
                             max_runs=None if self.rescreen is None else 1)
            if self.rescreen is None or not ran:
                break
        settled = self.rescreen is not None and not self.rescreen.untried_contenders(self.study)
        if settled and len(measured(self.study)) < p.trials:
            say(f"{PROG}: every screened config the simulator cannot tell from the best was searched")
        elif len(measured(self.study)) < p.trials:
            say(f"{PROG}: the time budget ({format_duration(p.time_budget)}) leaves the verdict two rounds "
                f"({format_duration(self.verdict_reserve_s())}): no further configs searched "
                f"(the longest search so far took {format_duration(longest_trial_s(self.study))})")
        return self.finish()

    def waiting(self) -> bool:
        """A trial waits in the study's queue (the next screened contender)."""
        return any(t.state == optuna.trial.TrialState.WAITING for t in self.study.get_trials(deepcopy=False))

    def trial_line(self, r: TrialReport) -> None:
        names = [k.name for k in self.p.search_space]
        knobs = "default config" if r.role == ROLE_DEFAULT else short_knobs(r.outcome.knobs, names)
        cap = TrialRecord.from_trial(self.study.trials[r.number]).capacity or {}
        high = (cap.get("bracket") or [None, None])[1]
        shown = Shown(*(lambda b: (b[0] or 0.0, math.inf if b[1] is None else b[1]))(
            (cap.get("shown") or {}).get("bracket") or [0.0, None]), self.p.measurement.level)
        best = "none yet" if r.best is None else f"{r.best.values[0]:.3g} req/s (#{r.best.number})"
        say(f"[{r.done}/{r.total}] #{r.number} {knobs} | searched {r.value:.3g} req/s ({r.value:.3g}-"
            f"{'?' if high is None else f'{high:.3g}'}), {shown.format()} | best searched {best} | "
            f"{format_duration(r.seconds)}")

    def screen(self) -> None:
        """The simulator, its step times rescaled to the steps the engine ran, screens the space for capacity; the
        best becomes the next trial, its search starting at its predicted capacity. After each trial the speed is
        refitted to all the real trials so far and, when it moved, the configs are screened again, so that each next
        screened trial is the best at the engine's present speed."""
        n = self.s.screen or SCREENED
        top = max(0, self.p.trials - 1)
        kind = self.s.kind
        if kind is not None and kind.name != "slotune":
            # the simulator's step-time model is calibrated on slotune's engine only
            say(f"{PROG}: no step-time model is calibrated on {kind.name}: the search runs on the engine alone, "
                f"the configs picked by the {self.p.sampler} sampler")
            return

        def rank(model: StepTimeModel | None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
            # on a simulated engine (tests) the screen is that simulator itself
            sim = self.twin(model)
            scaled = rescale_text(model)
            if not rescreen.rankings:
                say(f"{PROG}: screening {design_words(self.p, n, self.s.design_seed)} for capacity in the simulator"
                    + (f" ({scaled})" if scaled else "") + f", the best {SCREEN_REDRAWN} on {SCREEN_DRAWS} arrival "
                    "draws ...")
            else:
                say(f"{PROG}: the engine's speed moved from x{rescreen.scale:.2f} to x{speed_scale(model):.2f} "
                    f"({scaled}): screening the {n} configs again ...")
            t0 = time.monotonic()
            ranked = screen_capacity(self.p, sim, n, self.s.trials_dir / "screen" / f"ranking-{rescreen.rankings}",
                                     seed=self.s.design_seed)
            names = [k.name for k in self.p.search_space]
            say(f"{PROG}: screened {len(ranked)} configs in {format_duration(time.monotonic() - t0)}; the best "
                f"{top} by their worst draw: " + ", ".join(
                    f"{short_knobs(c.knobs, names)} " + "/".join(f"{v:.3g}" for v in c.capacities)
                    for c in ranked[:top]) + " req/s")
            # the search starts at the typical draw's capacity, as one engine search sees one draw
            return [(c.params, capacity_prediction(c.typical, c.capacities, c.bound)) for c in ranked]

        rescreen = Rescreen(None if isinstance(self.runner, SimTrialRunner)
                            else load_profile(dtype=engine_dtype(self.runner)), rank, top=top,
                            margin=self.p.capacity.resolution)
        self.rescreen = rescreen
        rescreen.enqueue_next(self.study)
        near = len(rescreen.contenders())
        worst = rescreen.largest_allowance()
        model = f" and up to +{worst:.0%} for its step times at their step shapes" if worst else ""
        say(f"{PROG}: {near} screened config{'s' if near != 1 else ''} the simulator cannot tell from the best (its "
            f"best draw, +{self.p.capacity.resolution:.0%} for the simulator's error{model}, reaches the best's "
            f"worst): the engine searches {'it' if near == 1 else 'them'} in turn, {min(near, top)} at most in this "
            "budget" + (" (trials)" if near > top else ""))

    def searches_deadline(self) -> float:
        """The further searches leave the verdict two full rounds (its budget at most): a search is not started
        unless the longest so far would end before this (a time.monotonic()), and starts no probe after it. A second
        candidate searched is worth more than the verdict's later rounds, but not than its second: a candidate's
        first rate (one step below its search's claim, on one draw) is often above what fresh draws show served,
        and the second round steps down."""
        return self.s.started + self.p.time_budget - self.verdict_reserve_s()

    def verdict_reserve_s(self) -> float:
        return min(self.p.verdict.budget, 2 * self.switching_plan().full_round_s(self.default_capacity()))

    def default_capacity(self) -> float:
        """The default config's searched capacity (0 while unknown): the verdict measures near it, and below
        1 req/s its windows are longer."""
        return next((float(t.values[0]) for t in measured(self.study)
                     if TrialRecord.from_trial(t).role == ROLE_DEFAULT and t.values), 0.0)

    def switching_plan(self) -> VerdictPlan:
        """The verdict's plan, with the mean start (and warm-up) of a server per configuration as the cost of each
        measurement's config change (the default and the candidates alternate)."""
        restarted = self.s.restarted
        ups = [start.seconds + start.warm_s for start in restarted.starts if start.ok] if restarted is not None else []
        self.plan = replace(self.plan, switch_s=sum(ups) / len(ups) if ups else 0.0)
        return self.plan

    def after_trial(self, r: TrialReport) -> None:
        """The trial's line, then the next screened trial, ranked at the engine's speed (not when no further search
        could start before the deadline: a ranking nobody searches is time the verdict loses)."""
        self.trial_line(r)
        if self.rescreen is not None and r.done < r.total and starts_in_time(self.study, self.searches_deadline()):
            self.rescreen.enqueue_next(self.study)

    # ------------------------------------------------------------------------------------------------ verdict

    def contenders(self) -> tuple[Contender, list[Contender]]:
        """The default config and the best candidates by searched capacity. No search probe is pooled into the
        verdict: the searches ran in windows from an idle engine and the candidates were picked for how theirs went
        (the winner's curse); the verdict's claims rest on its own sustained measurements on fresh draws."""
        rec = {t.number: TrialRecord.from_trial(t) for t in measured(self.study)}
        trials = [t for t in measured(self.study) if rec[t.number].capacity is not None]
        default = next(t for t in trials if rec[t.number].role == ROLE_DEFAULT)
        others = sorted((t for t in trials if rec[t.number].role != ROLE_DEFAULT and t.values[0] > 0),
                        key=lambda t: -t.values[0])[:self.p.verdict.candidates]

        def high(t: optuna.trial.FrozenTrial) -> float:
            h = ((rec[t.number].capacity or {}).get("bracket") or [None, None])[1]
            return math.inf if h is None else float(h)

        d = Contender(DEFAULT, dict(rec[default.number].knobs or {}), default.values[0], search_high=high(default))
        # a candidate's searched capacity is the best of the searched configs on one draw: its verdict starts below
        # it, where fresh draws are likely to show it served (verdict.first_rate)
        return d, [Contender(f"candidate {i + 1} (trial #{t.number})", dict(rec[t.number].knobs or {}), t.values[0],
                             search_high=high(t), next_rate=first_rate(t.values[0], d.search_high, self.plan.step))
                   for i, t in enumerate(others)]

    def measure_at(self, c: Contender, rate: float, draw: int) -> Sample:
        """One sustained measurement of the contender at ``rate`` on arrival draw ``draw`` (VerdictPlan), its lines."""
        say(f"  {c.name}, draw {draw}, {rate:.3g} req/s: one window of "
            f"{format_duration(self.plan.spec_at(c, rate).sustained_s)} ...")
        m = self.plan.measure(self.runner, c, rate, draw, self.s.trials_dir / "verdict")
        say(f"  {c.name}, draw {draw}, {rate:.3g} req/s: {m.describe()}")
        return sample_of(m, draw)

    def finish(self) -> int:
        p = self.p
        default, candidates = self.contenders()
        if not candidates:
            return none_shown(self.s, self.runner, self.study)
        # the verdict gets what is left of the run's budget (one round at least): its reserve when the searches used
        # theirs, more when they ended early (a second round that steps down to a new rate costs more than half the
        # reserve, and a run that stopped with a third of its budget unused left its candidate undecided)
        self.switching_plan()
        budget = max(0.0, self.s.started + p.time_budget - time.monotonic())
        c_level, d_level = pool_levels(p.measurement.level, len(candidates))
        near = self.default_capacity()
        say(f"{PROG}: verdict: the default and {len(candidates)} candidate(s) at fixed rates on fresh arrival draws, "
            f"the same draw for every config in a round: a candidate below its searched capacity in one window of "
            f"{format_duration(self.plan.window_for(False))}, the default beside it on the same arrivals "
            f"({format_duration(self.plan.window_for(True))}) and at its own ceiling "
            f"({format_duration(self.plan.window_for(True, beside=False))})"
            + (" at 1 req/s and above (longer below, holding as many blocks)" if near < 1 else "")
            + f"; rounds while {format_duration(budget)} holds them (the first "
            f"{format_duration(self.plan.full_round_s(near))}); claims "
            f"at {p.measurement.level:.0%} together (candidate pools at {c_level:.2%}, the default's at "
            f"{d_level:.2%}) ...")
        result = paired_verdict(default, candidates, self.measure_at, p.verdict.max_rounds, budget,
                                p.measurement.level, step=self.plan.step, floor=MIN_RATE,
                                first_draw=self.s.draws.verdict, on_round=self.round_line,
                                cost=self.plan.round_cost)
        chosen, held = self.choose(result)
        return self.write(result, chosen, held)

    def twin(self, model: StepTimeModel | None) -> SimTrialRunner:
        """The simulator that stands for the engine with ``model``'s step times (a simulated engine, in tests: that
        simulator itself)."""
        return self.runner if isinstance(self.runner, SimTrialRunner) else sim_runner_like(self.runner, model=model)

    def confirmed(self, result: VerdictResult) -> list[dict[str, Any]]:
        """Each screened config the engine searched, against the simulator's twin of its search (the step times
        rescaled to all the engine's steps): tuner/search/confirmation.py."""
        in_verdict = [c for c in result.candidates if c.rounds]

        def sustained(knobs: dict[str, Any]) -> list[float | None] | None:
            c = next((c for c in in_verdict if c.knobs == knobs), None)
            return c.shown().as_list() if c is not None else None

        if self.s.engine_name != "slotune":  # the simulator's step times are calibrated on slotune's engine only
            return []
        model = self.rescreen.fitted(self.study) if self.rescreen is not None else None
        return confirmed_rows(self.study, self.twin(model), self.p, self.s.trials_dir / "twin", sustained)

    def simulator_error(self, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The run's summary of the simulator against the engine (None: no simulator for this engine), said and kept
        in the study beside the rows it summarises."""
        if self.s.engine_name != "slotune":
            return None
        summary = simulator_error(rows)
        stamp(self.study, simulator_vs_engine_attrs({**summary, "rows": [
            {k: r[k] for k in ("trial", "knobs", "measured", "bracket", "twin", "twin_bracket", "predicted")}
            for r in rows]}))
        say(f"{PROG}: {error_words(summary)}")
        return summary

    def restarts_text(self) -> str:
        """With a server per configuration: how much of the run went to starting servers."""
        return self.s.restarted.starts_note() if self.s.restarted is not None else ""

    def round_line(self, r: int, result: VerdictResult) -> None:
        parts = [f"{c.name.split(' (')[0]} {c.shown().format()}" + ("" if c.is_default else f" {result.outcome(c)}")
                 for c in [result.default] + result.candidates]
        say(f"  round {r}: " + "; ".join(parts))

    def choose(self, result: VerdictResult) -> tuple[Contender, bool]:
        """The winner (shown better on fresh draws), else the safest config; its capacity is what fresh draws showed,
        not its search's."""
        w = result.winner
        if w is not None:
            say(f"{PROG}: {w.name}: searched capacity {w.claim:.3g} req/s on one draw, {w.shown().low:.3g} "
                f"req/s shown served on fresh draws")
            return w, True
        safest = result.safest
        for c in result.candidates:
            if c.shown().low <= 0 and c is safest:
                say(f"{PROG}: {c.name} was not shown to serve any rate on fresh draws, nor was any config; it is "
                    f"written for attaining more than the default on the same arrivals (not a capacity claim)")
            elif c.shown().low <= 0:
                say(f"{PROG}: {c.name} was not shown to serve any rate on fresh draws: not written as tuned")
        return safest, False

    def write(self, result: VerdictResult, chosen: Contender, held: bool) -> int:
        p, s = self.p, self.s
        line = verdict_line(result, p.slo.words())
        report = s.out.with_suffix(".html")
        vllm_path = s.out.with_suffix(".vllm.txt")
        kind = s.engine_name
        vllm = write_vllm(vllm_path, chosen.knobs, self.model, kind)
        confirmed = self.confirmed(result)
        evidence: dict[str, Any] = {"verdict": result.as_dict(), "verdict_line": line, "floor": self.floor,
                                    "tuned_is_default": chosen is result.default, "held": held,
                                    "confirmed": confirmed, "simulator_error": self.simulator_error(confirmed),
                                    "design_seed": s.design_seed}
        write_tuned_yaml(s.out, knobs=chosen.knobs, slo=p.slo.as_dict(), workload=p.workload.as_dict(), rate=0.0,
                         rate_reason="capacity objective: the rate is searched per config", objective=p.objective,
                         model=self.model, study_name=s.study_name,
                         storage=s.storage_url, tuned=None, default=None,
                         remeasured=None, vllm=vllm, report=report, trials=len(self.study.trials),
                         capacity=capacity_section(result, chosen), evidence=evidence)
        write_report(report, self.study, p.slo.as_dict(), f"tune: {s.study_name}", [line])
        serve = f"slotune serve --config {s.out}" if kind == "slotune" else f"the flags in {vllm_path}"
        say(f"{PROG}: wrote {s.out} (serve it: {serve}), {report}, {vllm_path}")
        code = self.apply(chosen)
        say(f"{PROG}: done in {format_duration(time.monotonic() - s.started)}" + self.restarts_text())
        say(line)
        return code

    def apply(self, chosen: Contender) -> int:
        """--apply: the config written as tuned left applied in the engine at --engine-url."""
        s = self.s
        if not s.apply or s.handle is None or s.restarted is not None:
            return 0
        try:
            applied = s.handle.patch_config(chosen.knobs)
        except (ConfigRejected, EngineError) as error:
            print(f"{PROG}: error: could not apply the tuned config to {s.handle.url}: {error}", file=sys.stderr)
            return 1
        s.applied = True  # kept on the way out (the engine does not get its original config back)
        say(f"{PROG}: applied to {s.handle.url}: {short_knobs(applied)}")
        return 0
