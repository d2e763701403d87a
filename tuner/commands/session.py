"""One ``tune`` run: engine (started or given), offered rate, the study's trials with a progress line each, the
re-measure of the winner, and the outputs (tuned.yaml, vLLM flags, HTML report); ``--apply`` leaves the tuned
knobs in the engine, otherwise a given engine gets its original config back."""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import optuna
from optuna.trial import TrialState

from slotune.units import format_duration
from tuner.commands.progress import PROG, say
from tuner.commands.run_context import RunContext
from policies import Policy
from tuner.trials.engine_handle import ConfigRejected, EngineError, EngineHandle, ManagedEngine
from tuner.trials.engine_kinds import ServerKind
from tuner.trials.restarted_engine import RestartedEngine
from engine.knobs import short_knobs
from tuner.output import write_report, write_tuned_yaml, write_vllm
from tuner.search.auto_rate import choose_rate
from tuner.simulation.step_time_model import StepTimeModel
from tuner.search.study import (ROLE_DEFAULT, TrialReport, best_trial, closest_trial, counted_trials,
                         default_trial, enqueue_default, open_study, recover_orphans, run_trials,
                         study_name_for)
from tuner.search.trial_record import (StudyRecord, TrialRecord, design_seed_attrs, goodput_prediction, rate_attrs,
                                       stamp, study_attrs)
from tuner.measure.measurement import Draws
from tuner.trials.trial_runner import TrialOutcome, TrialRunner

if TYPE_CHECKING:
    from tuner.search.rescreen import Rescreen



class TuneSession:
    def __init__(self, args: argparse.Namespace, policy: Policy, storage: optuna.storages.BaseStorage,
                 token: str | None, kind: ServerKind | None = None) -> None:
        self.args = args
        self.kind = kind  # --engine vllm|command: the server started per configuration
        self.restarted: RestartedEngine | None = None
        self.policy = policy
        self.storage = storage
        self.token = token
        self.managed: ManagedEngine | None = None
        self.handle: EngineHandle | None = None
        self.original_config: dict[str, Any] | None = None
        self.study_name = args.study_name or study_name_for(policy, policy.rate)
        self.out = Path(args.out).resolve()
        self.trials_dir = self.out.parent / f"{self.out.stem}-trials" / self.study_name
        self.started = time.monotonic()
        self.trial_seconds: list[float] = []
        self.applied = False
        self.rescreen: Rescreen | None = None  # --screen: the screen kept at the engine's speed
        self.draws = Draws(policy.seed)
        # the screen's space-filling design: the run's seed when one is given, else a fresh one per run (recorded in
        # the study, so that a resumed run screens the same configs, and in tuned.yaml)
        self.design_seed = args.seed if getattr(args, "seed", None) is not None else secrets.randbelow(2**31)

    # ---------------------------------------------------------------------------------------------- engine

    def start_engine(self) -> EngineHandle:
        if self.kind is not None:
            return self.start_restarted(self.kind)
        if self.args.engine_url:
            self.handle = EngineHandle(self.args.engine_url, self.token)
            if not self.handle.alive():
                raise EngineError(f"no engine answers at {self.args.engine_url}/health")
            self.original_config = self.handle.get_config()  # also checks the token
            return self.handle
        model = f" --model {self.args.model}" if self.args.model else ""
        say(f"{PROG}: starting the default engine (slotune serve{model}) ...")
        self.managed = ManagedEngine(model=self.args.model,
                                     log_path=str(self.trials_dir.parent / "engine.log"))
        self.trials_dir.parent.mkdir(parents=True, exist_ok=True)
        self.handle = self.managed.start()
        say(f"{PROG}: engine up at {self.handle.url} in {time.monotonic() - self.started:.0f}s "
            f"(log: {self.managed.log_path})")
        return self.handle

    def start_restarted(self, kind: ServerKind) -> EngineHandle:
        """--engine vllm|command: the server with the engine's own defaults first (they are read back from it and
        are the baseline), then a server per configuration."""
        logs = self.trials_dir.parent / "servers"
        say(f"{PROG}: starting {kind.name} with its own defaults (a server per configuration; logs: {logs}) ...")
        self.restarted = RestartedEngine(kind, logs, startup_timeout=self.args.engine_start_timeout)
        defaults = self.restarted.defaults()
        assert self.restarted.handle is not None
        self.handle = self.restarted.handle
        start = self.restarted.starts[-1]
        say(f"{PROG}: {kind.name} up at {self.handle.url} in {start.seconds:.0f}s; its defaults as it resolved them: "
            + (short_knobs(defaults) if defaults else "(the server does not say; the baseline is its command with "
               "no knob flags)"))
        return self.handle

    def close(self) -> None:
        if self.restarted is not None:
            self.restarted.stop()
        if self.handle is not None and self.original_config is not None and not self.applied:
            try:  # a given engine gets back the config it had before the study
                self.handle.patch_config(self.original_config)
            except Exception:  # best effort on the way out
                pass
        if self.managed is not None:
            self.managed.stop()

    # ---------------------------------------------------------------------------------------------- run

    def run(self) -> int:
        p = self.policy
        try:
            handle = self.start_engine()
        except (EngineError, ConfigRejected) as error:
            print(f"{PROG}: error: {error}", file=sys.stderr)
            return 1
        model = handle.model()
        runner = TrialRunner(self.restarted or self.managed or handle, workload=p.workload, rate=p.rate or 1.0,
                             duration=p.trial_duration, warmup=p.warmup, slo=p.slo, pruning=p.pruning, seed=p.seed,
                             busy_cores=p.measurement.busy, server_warmup=p.server_warmup)
        try:
            study = open_study(self.storage, self.study_name, p)
        except ValueError as error:
            print(f"{PROG}: error: argument --study-name: {error}", file=sys.stderr)
            return 2
        if p.objective == "capacity":
            return self.run_capacity(study, runner, model)
        rate, rate_reason = self.choose_rate(study, runner)
        runner.rate = rate
        stamp(study, {**study_attrs(slo=p.slo.as_dict(), workload=p.workload.as_dict(), objective=p.objective,
                                    model=model, policy=p.to_dict()), **rate_attrs(rate, rate_reason)})
        recovered = recover_orphans(study)
        if recovered:
            say(f"{PROG}: trial(s) {', '.join(map(str, recovered))} of a run that died are marked failed and redone")
        enqueue_default(study)
        done_before = counted_trials(study)
        say(f"{PROG}: study {self.study_name!r}: {p.trials} trials of {format_duration(p.trial_duration)} "
            f"(+{format_duration(p.warmup)} warm-up) at {rate:.3g} req/s, {p.sampler} sampler, objective "
            f"{p.objective}, SLO {self.slo_text()}" + (f"; resuming with {done_before} done" if done_before else ""))
        try:
            if getattr(self.args, "screen", None):
                self.screen(study, runner)
            run_trials(study, runner, p, p.trials, self.trials_dir, on_trial=self.after_trial(study))
        except EngineError as error:
            print(f"{PROG}: error: {error}", file=sys.stderr)
            return 1
        return self.finish(study, runner, model, rate, rate_reason)

    def context(self) -> RunContext:
        """What the objective's runner needs of this run."""
        return RunContext(self.policy, self.study_name, self.storage_url(), self.out, self.trials_dir, self.started,
                          self.draws, self.design_seed, getattr(self.args, "screen", None),
                          bool(getattr(self.args, "apply", False)), self.handle, self.kind, self.restarted)

    def storage_url(self) -> str:
        return str(getattr(self.storage, "url", type(self.storage).__name__))

    def run_capacity(self, study: optuna.Study, runner: TrialRunner, model: str | None) -> int:
        """The default objective: capacity per config, the paired verdict (tuner/commands/capacity_run.py)."""
        p = self.policy
        stamp(study, study_attrs(slo=p.slo.as_dict(), workload=p.workload.as_dict(), objective=p.objective,
                                 model=model, policy=p.to_dict()))
        stored = StudyRecord.from_study(study).design_seed
        self.design_seed = int(stored) if stored is not None else self.design_seed
        stamp(study, design_seed_attrs(self.design_seed))
        recovered = recover_orphans(study)
        if recovered:
            say(f"{PROG}: trial(s) {', '.join(map(str, recovered))} of a run that died are marked failed and redone")
        enqueue_default(study)
        # imported here: it loads the simulator (the engine's scheduler), which the goodput objective never needs
        from tuner.commands.capacity_run import CapacityRun

        context = self.context()
        try:
            return CapacityRun(context, runner, study, model).run()
        except EngineError as error:
            print(f"{PROG}: error: {error}", file=sys.stderr)
            return 1
        finally:
            self.applied = context.applied  # an engine the tuned config was applied to keeps it on the way out

    def screen(self, study: optuna.Study, runner: TrialRunner) -> None:
        """--screen N: the simulator screens N configs at the engine's measured speed and the best becomes the next
        trial. After each real trial the speed is refitted to all the real trials so far and, when it moved, the
        configs are screened again, so that each next screened trial is the best at the engine's present speed
        (predicted against measured is printed at the end)."""
        # the simulator (it runs the engine's torch-free scheduler) is imported only when asked for
        from tuner.search.rescreen import Rescreen, measured_steps, rescale_text, speed_scale
        from tuner.search.screening import (CONFIRMED, engine_dtype, load_profile,  # the simulator too
                                            predicted, screen, sim_runner_like)

        if not measured_steps(study):
            # the default config's trial (enqueued first) runs before the screen: its step records tell the
            # simulator how fast the engine runs now, which drifts from the profile's calibration
            run_trials(study, runner, self.policy, self.policy.trials, self.trials_dir, on_trial=self.progress,
                       max_runs=1)
        n = self.args.screen

        def rank(model: StepTimeModel | None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
            assert model is not None
            scaled = rescale_text(model)
            if not rescreen.rankings:
                say(f"{PROG}: screening {n} configs in the simulator"
                    + (f" ({scaled}: the steps the engine just ran)" if scaled
                       else " (profile as calibrated: no engine steps measured yet)") + " ...")
            else:
                say(f"{PROG}: the engine's speed moved from x{rescreen.scale:.2f} to x{speed_scale(model):.2f} "
                    f"({scaled or 'not rescaled'}; the real trials so far): screening the {n} configs again ...")
            t0 = time.monotonic()
            ranked = screen(policy=self.policy, runner=sim_runner_like(runner, model=model), n=n,
                            out_dir=self.trials_dir, seed=self.design_seed)
            if not rescreen.rankings:
                feasible = sum(s.outcome.feasible for s in ranked)
                say(f"{PROG}: screened {len(ranked)} configs in {format_duration(time.monotonic() - t0)}: {feasible} "
                    f"predicted feasible; the best {min(CONFIRMED, len(ranked))} are the next trials, each the best "
                    f"at the engine's speed after the trials before it (ranking: {self.trials_dir / 'screen.json'})")
            return [(s.params, goodput_prediction(predicted(s.outcome))) for s in ranked]

        rescreen = Rescreen(load_profile(dtype=engine_dtype(runner)), rank, top=CONFIRMED)
        self.rescreen = rescreen
        rescreen.enqueue_next(study)

    def after_trial(self, study: optuna.Study) -> Callable[[TrialReport], None]:
        """The progress line of a trial, then (--screen) the next screened trial, ranked at the engine's speed."""

        def on_trial(r: TrialReport) -> None:
            self.progress(r)
            if self.rescreen is not None and r.done < r.total:
                self.rescreen.enqueue_next(study)

        return on_trial

    def choose_rate(self, study: optuna.Study, runner: TrialRunner) -> tuple[float, str]:
        stored = StudyRecord.from_study(study)
        if stored.rate is not None:
            return float(stored.rate), str(stored.rate_reason or "") + " (from the resumed study)"
        if self.policy.rate is not None:
            return self.policy.rate, "given (--rate or the policy)"
        say(f"{PROG}: --rate auto: probing the default config ...")
        # Each probe is the measurement the study's default trial repeats (same window, warm-up and arrival seed):
        # shorter probes (8 s, ~16 requests at 2 req/s) decided on a few requests and on another arrival draw.
        probe = TrialRunner(runner.engine, workload=runner.workload, rate=1.0, duration=runner.duration,
                            warmup=runner.warmup, slo=runner.slo, pruning=None, seed=runner.seed,
                            base_knobs=runner.base_knobs, busy_cores=runner.busy_cores,
                            server_warmup=runner.server_warmup)
        choice = choose_rate(probe, self.trials_dir / "rate-auto",
                             on_probe=lambda r, o: say(f"  probe {r:.3g} req/s: {self.describe(o)}"))
        say(f"{PROG}: rate {choice.rate:.3g} req/s: {choice.reason}")
        return choice.rate, choice.reason

    def slo_text(self) -> str:
        return self.policy.slo.words()

    @staticmethod
    def describe(o: TrialOutcome) -> str:
        s = o.summary or {}
        att = s.get("attainment")
        return (f"goodput {s.get('goodput_rps') or 0.0:.2f} req/s, p99 TBT {format_duration(s.get('tbt_p99'))}, "
                f"p99 TTFT {format_duration(s.get('ttft_p99'))}, attainment {'-' if att is None else f'{att:.0%}'}, "
                + ("feasible" if o.feasible else f"infeasible: {o.reason}"))

    def progress(self, r: TrialReport) -> None:
        self.trial_seconds.append(r.seconds)
        left = max(0, r.total - r.done) * (sum(self.trial_seconds) / len(self.trial_seconds))
        best = "none feasible yet" if r.best is None else f"{r.best.values[0]:.2f} (#{r.best.number})"
        names = [k.name for k in self.policy.search_space]
        knobs = "default config" if r.role == ROLE_DEFAULT else short_knobs(r.outcome.knobs, names)
        value = f"capacity {r.value:.2f} req/s, " if self.policy.objective == "capacity" else ""
        say(f"[{r.done}/{r.total}] #{r.number} {knobs} | {value}{self.describe(r.outcome)} | best {best} | "
            f"{format_duration(r.seconds)}, ~{format_duration(left)} left")

    # ---------------------------------------------------------------------------------------------- results

    def finish(self, study: optuna.Study, runner: TrialRunner, model: str | None, rate: float,
               rate_reason: str) -> int:
        p = self.policy
        report = self.out.with_suffix(".html")
        best = best_trial(study)
        default = default_trial(study)
        title = f"tune: {self.study_name}"
        lines = [f"SLO {self.slo_text()}; workload {p.workload.name} (length x{p.workload.length_scale:g}) at "
                 f"{rate:.3g} req/s; rate: {rate_reason}"] + self.screened_lines(study)
        if best is None:
            return self.none_met(study, report, title, lines, rate)
        tuned = TrialRecord.from_trial(best)
        knobs = dict(tuned.knobs or {})
        say(f"{PROG}: best: trial #{best.number} {short_knobs(knobs)}: {p.objective} {best.values[0]:.2f} req/s"
            + (f" vs default {default.values[0]:.2f}" if default is not None else ""))
        confirm = self.remeasure(runner, knobs, tuned.rate or rate)
        vllm_path = self.out.with_suffix(".vllm.txt")
        kind = self.kind.name if self.kind is not None else "slotune"
        vllm = write_vllm(vllm_path, knobs, model, kind)
        write_tuned_yaml(self.out, knobs=knobs, slo=p.slo.as_dict(), workload=p.workload.as_dict(), rate=rate,
                         rate_reason=rate_reason, objective=p.objective, model=model, study_name=self.study_name,
                         storage=self.storage_url(), tuned=best,
                         default=default, remeasured=confirm.summary, vllm=vllm, report=report,
                         trials=len(study.trials))
        lines += [f"tuned (trial #{best.number}): {short_knobs(knobs)}: {self.describe(_as_outcome(best))}",
                  f"tuned, re-measured: {self.describe(confirm)}"]
        if default is not None:
            lines.append(f"default (trial #{default.number}): {self.describe(_as_outcome(default))}")
        write_report(report, study, p.slo.as_dict(), title, lines)
        serve = f"slotune serve --config {self.out}" if kind == "slotune" else f"the flags in {vllm_path}"
        say(f"{PROG}: wrote {self.out} (serve it: {serve}), {report}, {vllm_path}")
        say(f"  vLLM: {vllm.replace(chr(92) + chr(10) + '    ', '')}")
        if default is not None:
            self.say_against_default(best, default)
        say(f"{PROG}: done in {format_duration(time.monotonic() - self.started)}")
        return 0

    def screened_lines(self, study: optuna.Study) -> list[str]:
        """With --screen: the screened configs' predictions against the engine's measurements, said and returned
        for the report."""
        if not getattr(self.args, "screen", None):
            return []
        from tuner.search.screening import screen_report  # see TuneSession.screen

        screened = screen_report(study)
        if not screened:
            return []
        say(f"{PROG}: screened configs, simulator's prediction against the engine's measurement:\n{screened}")
        return ["Screened configs, predicted / measured:\n" + screened]

    def none_met(self, study: optuna.Study, report: Path, title: str, lines: list[str], rate: float) -> int:
        """No config met the SLO: the report, and the closest trial and what to try, on stderr."""
        closest = closest_trial(study)
        write_report(report, study, self.policy.slo.as_dict(), title, lines + ["No config met the SLO."])
        n = sum(t.state != TrialState.WAITING for t in study.get_trials(deepcopy=False))
        msg = f"{PROG}: no config met the SLO ({self.slo_text()}) in {n} trial{'s' * (n != 1)} at {rate:.3g} req/s."
        if closest is not None:
            near = TrialRecord.from_trial(closest)
            msg += (f"\n  closest (infeasible): trial #{closest.number} "
                    f"{short_knobs(near.knobs if near.knobs is not None else {})}: {near.reason}")
        msg += (f"\n  try a looser target, a lower --rate, or more --trials; report: {report}")
        print(msg, file=sys.stderr)
        return 1

    def remeasure(self, runner: TrialRunner, knobs: dict[str, Any], rate: float) -> TrialOutcome:
        """The winner measured again at ``rate`` (the rate it was measured at; capacity: its highest attaining
        rate); with --apply it is left applied."""
        say(f"{PROG}: re-measuring the tuned config{' and applying it' if self.args.apply else ''} ...")
        confirm = runner.run(knobs, self.trials_dir / "remeasure", rate=rate)
        say(f"  re-measured: {self.describe(confirm)}")
        if self.args.apply:
            assert self.handle is not None
            applied = self.handle.patch_config(knobs)
            self.applied = True
            say(f"{PROG}: applied to {self.handle.url}: {short_knobs(applied)}")
        return confirm

    def say_against_default(self, best: optuna.trial.FrozenTrial, default: optuna.trial.FrozenTrial) -> None:
        d = TrialRecord.from_trial(default).summary
        if not d:
            return
        ratio = best.values[0] / default.values[0] if default.values[0] > 0 else None
        say(f"  {self.policy.objective} tuned {best.values[0]:.2f} req/s vs default {default.values[0]:.2f} req/s"
            + (f" ({ratio:.2f}x)" if ratio else "") + f"; p99 TBT tuned "
            f"{format_duration((TrialRecord.from_trial(best).summary or {}).get('tbt_p99'))} vs default "
            f"{format_duration(d.get('tbt_p99'))}")


def _as_outcome(t: optuna.trial.FrozenTrial) -> TrialOutcome:
    a = TrialRecord.from_trial(t)
    return TrialOutcome(a.knobs if a.knobs is not None else {}, a.summary if a.summary is not None else {},
                        a.step_stats if a.step_stats is not None else {}, bool(a.feasible), a.reason, None)
