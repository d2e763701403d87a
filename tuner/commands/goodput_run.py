"""``tune --objective goodput``: the offered rate (given, resumed or probed on the default config), the study's trials
at that rate with a progress line each (with ``--screen``, each next trial the simulator's best at the engine's
measured speed), the winner re-measured, and the outputs (tuned.yaml, vLLM flags, HTML report)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import optuna
from optuna.trial import TrialState

from engine.knobs import short_knobs
from slotune.units import format_duration
from tuner.commands.progress import PROG, say
from tuner.commands.run_context import RunContext
from tuner.output import write_report, write_tuned_yaml, write_vllm
from tuner.search.auto_rate import choose_rate
from tuner.search.study import ROLE_DEFAULT, TrialReport, best_trial, closest_trial, counted_trials, default_trial, \
    run_trials
from tuner.search.trial_record import StudyRecord, TrialRecord, goodput_prediction, rate_attrs, stamp
from tuner.trials.trial_runner import TrialOutcome, TrialRunner

if TYPE_CHECKING:
    from tuner.search.rescreen import Rescreen
    from tuner.simulation.step_time_model import StepTimeModel


def describe(o: TrialOutcome) -> str:
    """A trial's figures at its rate, in words."""
    s = o.summary or {}
    att = s.get("attainment")
    return (f"goodput {s.get('goodput_rps') or 0.0:.2f} req/s, p99 TBT {format_duration(s.get('tbt_p99'))}, "
            f"p99 TTFT {format_duration(s.get('ttft_p99'))}, attainment {'-' if att is None else f'{att:.0%}'}, "
            + ("feasible" if o.feasible else f"infeasible: {o.reason}"))


class GoodputRun:
    def __init__(self, context: RunContext, runner: TrialRunner, study: optuna.Study, model: str | None) -> None:
        self.s = context
        self.p = context.policy
        self.runner = runner
        self.study = study
        self.model = model
        self.trial_seconds: list[float] = []
        self.rescreen: Rescreen | None = None  # --screen: the screen kept at the engine's speed

    def run(self) -> int:
        p = self.p
        rate, rate_reason = self.choose_rate()
        self.runner.rate = rate
        stamp(self.study, rate_attrs(rate, rate_reason))
        done_before = counted_trials(self.study)
        say(f"{PROG}: study {self.s.study_name!r}: {p.trials} trials of {format_duration(p.trial_duration)} "
            f"(+{format_duration(p.warmup)} warm-up) at {rate:.3g} req/s, {p.sampler} sampler, objective "
            f"{p.objective}, SLO {self.s.slo_text()}" + (f"; resuming with {done_before} done" if done_before else ""))
        if self.s.screen:
            self.screen(self.s.screen)
        run_trials(self.study, self.runner, p, p.trials, self.s.trials_dir, on_trial=self.after_trial())
        return self.finish(rate, rate_reason)

    def screen(self, n: int) -> None:
        """--screen N: the simulator screens N configs at the engine's measured speed and the best becomes the next
        trial. After each real trial the speed is refitted to all the real trials so far and, when it moved, the
        configs are screened again, so that each next screened trial is the best at the engine's present speed
        (predicted against measured is printed at the end)."""
        # the simulator (it runs the engine's torch-free scheduler) is imported only when asked for
        from tuner.search.rescreen import Rescreen, measured_steps, rescale_text, speed_scale
        from tuner.search.screening import (CONFIRMED, engine_dtype, load_profile,  # the simulator too
                                            predicted, screen, sim_runner_like)

        if not measured_steps(self.study):
            # the default config's trial (enqueued first) runs before the screen: its step records tell the
            # simulator how fast the engine runs now, which drifts from the profile's calibration
            run_trials(self.study, self.runner, self.p, self.p.trials, self.s.trials_dir, on_trial=self.progress,
                       max_runs=1)

        def rank(model: StepTimeModel | None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
            assert model is not None  # Rescreen ranks with the profile it was given, never with None
            scaled = rescale_text(model)
            if not rescreen.rankings:
                say(f"{PROG}: screening {n} configs in the simulator"
                    + (f" ({scaled}: the steps the engine just ran)" if scaled
                       else " (profile as calibrated: no engine steps measured yet)") + " ...")
            else:
                say(f"{PROG}: the engine's speed moved from x{rescreen.scale:.2f} to x{speed_scale(model):.2f} "
                    f"({scaled or 'not rescaled'}; the real trials so far): screening the {n} configs again ...")
            t0 = time.monotonic()
            ranked = screen(policy=self.p, runner=sim_runner_like(self.runner, model=model), n=n,
                            out_dir=self.s.trials_dir, seed=self.s.design_seed)
            if not rescreen.rankings:
                feasible = sum(s.outcome.feasible for s in ranked)
                say(f"{PROG}: screened {len(ranked)} configs in {format_duration(time.monotonic() - t0)}: {feasible} "
                    f"predicted feasible; the best {min(CONFIRMED, len(ranked))} are the next trials, each the best "
                    f"at the engine's speed after the trials before it (ranking: {self.s.trials_dir / 'screen.json'})")
            return [(s.params, goodput_prediction(predicted(s.outcome))) for s in ranked]

        rescreen = Rescreen(load_profile(dtype=engine_dtype(self.runner)), rank, top=CONFIRMED)
        self.rescreen = rescreen
        rescreen.enqueue_next(self.study)

    def after_trial(self) -> Callable[[TrialReport], None]:
        """The progress line of a trial, then (--screen) the next screened trial, ranked at the engine's speed."""

        def on_trial(r: TrialReport) -> None:
            self.progress(r)
            if self.rescreen is not None and r.done < r.total:
                self.rescreen.enqueue_next(self.study)

        return on_trial

    def choose_rate(self) -> tuple[float, str]:
        stored = StudyRecord.from_study(self.study)
        if stored.rate is not None:
            return float(stored.rate), str(stored.rate_reason or "") + " (from the resumed study)"
        if self.p.rate is not None:
            return self.p.rate, "given (--rate or the policy)"
        say(f"{PROG}: --rate auto: probing the default config ...")
        # Each probe is the measurement the study's default trial repeats (same window, warm-up and arrival seed):
        # shorter probes (8 s, ~16 requests at 2 req/s) decided on a few requests and on another arrival draw.
        runner = self.runner
        probe = TrialRunner(runner.engine, workload=runner.workload, rate=1.0, duration=runner.duration,
                            warmup=runner.warmup, slo=runner.slo, pruning=None, seed=runner.seed,
                            base_knobs=runner.base_knobs, busy_cores=runner.busy_cores,
                            server_warmup=runner.server_warmup)
        choice = choose_rate(probe, self.s.trials_dir / "rate-auto",
                             on_probe=lambda r, o: say(f"  probe {r:.3g} req/s: {describe(o)}"))
        say(f"{PROG}: rate {choice.rate:.3g} req/s: {choice.reason}")
        return choice.rate, choice.reason

    def progress(self, r: TrialReport) -> None:
        self.trial_seconds.append(r.seconds)
        left = max(0, r.total - r.done) * (sum(self.trial_seconds) / len(self.trial_seconds))
        best = "none feasible yet" if r.best is None else f"{r.best.values[0]:.2f} (#{r.best.number})"
        knobs = "default config" if r.role == ROLE_DEFAULT else short_knobs(r.outcome.knobs,
                                                                            [k.name for k in self.p.search_space])
        say(f"[{r.done}/{r.total}] #{r.number} {knobs} | {describe(r.outcome)} | best {best} | "
            f"{format_duration(r.seconds)}, ~{format_duration(left)} left")

    # ---------------------------------------------------------------------------------------------- results

    def finish(self, rate: float, rate_reason: str) -> int:
        p, s = self.p, self.s
        report = s.out.with_suffix(".html")
        best = best_trial(self.study)
        default = default_trial(self.study)
        title = f"tune: {s.study_name}"
        lines = [f"SLO {s.slo_text()}; workload {p.workload.name} (length x{p.workload.length_scale:g}) at "
                 f"{rate:.3g} req/s; rate: {rate_reason}"] + self.screened_lines()
        if best is None:
            return self.none_met(report, title, lines, rate)
        tuned = TrialRecord.from_trial(best)
        knobs = dict(tuned.knobs or {})
        say(f"{PROG}: best: trial #{best.number} {short_knobs(knobs)}: {p.objective} {best.values[0]:.2f} req/s"
            + (f" vs default {default.values[0]:.2f}" if default is not None else ""))
        confirm = self.remeasure(knobs, tuned.rate or rate)
        vllm_path = s.out.with_suffix(".vllm.txt")
        vllm = write_vllm(vllm_path, knobs, self.model, s.engine_name)
        write_tuned_yaml(s.out, knobs=knobs, slo=p.slo.as_dict(), workload=p.workload.as_dict(), rate=rate,
                         rate_reason=rate_reason, objective=p.objective, model=self.model, study_name=s.study_name,
                         storage=s.storage_url, tuned=best, default=default, remeasured=confirm.summary, vllm=vllm,
                         report=report, trials=len(self.study.trials))
        lines += [f"tuned (trial #{best.number}): {short_knobs(knobs)}: {describe(_as_outcome(best))}",
                  f"tuned, re-measured: {describe(confirm)}"]
        if default is not None:
            lines.append(f"default (trial #{default.number}): {describe(_as_outcome(default))}")
        write_report(report, self.study, p.slo.as_dict(), title, lines)
        serve = f"slotune serve --config {s.out}" if s.engine_name == "slotune" else f"the flags in {vllm_path}"
        say(f"{PROG}: wrote {s.out} (serve it: {serve}), {report}, {vllm_path}")
        say(f"  vLLM: {vllm.replace(chr(92) + chr(10) + '    ', '')}")
        if default is not None:
            self.say_against_default(best, default)
        say(f"{PROG}: done in {format_duration(time.monotonic() - s.started)}")
        return 0

    def screened_lines(self) -> list[str]:
        """With --screen: the screened configs' predictions against the engine's measurements, said and returned
        for the report."""
        if not self.s.screen:
            return []
        from tuner.search.screening import screen_report  # the simulator: only with --screen

        screened = screen_report(self.study)
        if not screened:
            return []
        say(f"{PROG}: screened configs, simulator's prediction against the engine's measurement:\n{screened}")
        return ["Screened configs, predicted / measured:\n" + screened]

    def none_met(self, report: Path, title: str, lines: list[str], rate: float) -> int:
        """No config met the SLO: the report, and the closest trial and what to try, on stderr."""
        closest = closest_trial(self.study)
        write_report(report, self.study, self.p.slo.as_dict(), title, lines + ["No config met the SLO."])
        n = sum(t.state != TrialState.WAITING for t in self.study.get_trials(deepcopy=False))
        msg = f"{PROG}: no config met the SLO ({self.s.slo_text()}) in {n} trial{'s' * (n != 1)} at {rate:.3g} req/s."
        if closest is not None:
            near = TrialRecord.from_trial(closest)
            msg += (f"\n  closest (infeasible): trial #{closest.number} "
                    f"{short_knobs(near.knobs if near.knobs is not None else {})}: {near.reason}")
        msg += (f"\n  try a looser target, a lower --rate, or more --trials; report: {report}")
        print(msg, file=sys.stderr)
        return 1

    def remeasure(self, knobs: dict[str, Any], rate: float) -> TrialOutcome:
        """The winner measured again at the rate it was measured at; with --apply it is left applied."""
        say(f"{PROG}: re-measuring the tuned config{' and applying it' if self.s.apply else ''} ...")
        confirm = self.runner.run(knobs, self.s.trials_dir / "remeasure", rate=rate)
        say(f"  re-measured: {describe(confirm)}")
        if self.s.apply and self.s.handle is not None:
            applied = self.s.handle.patch_config(knobs)
            self.s.applied = True
            say(f"{PROG}: applied to {self.s.handle.url}: {short_knobs(applied)}")
        return confirm

    def say_against_default(self, best: optuna.trial.FrozenTrial, default: optuna.trial.FrozenTrial) -> None:
        d = TrialRecord.from_trial(default).summary
        if not d:
            return
        ratio = best.values[0] / default.values[0] if default.values[0] > 0 else None
        say(f"  {self.p.objective} tuned {best.values[0]:.2f} req/s vs default {default.values[0]:.2f} req/s"
            + (f" ({ratio:.2f}x)" if ratio else "") + f"; p99 TBT tuned "
            f"{format_duration((TrialRecord.from_trial(best).summary or {}).get('tbt_p99'))} vs default "
            f"{format_duration(d.get('tbt_p99'))}")


def _as_outcome(t: optuna.trial.FrozenTrial) -> TrialOutcome:
    a = TrialRecord.from_trial(t)
    return TrialOutcome(a.knobs if a.knobs is not None else {}, a.summary if a.summary is not None else {},
                        a.step_stats if a.step_stats is not None else {}, bool(a.feasible), a.reason, None)
