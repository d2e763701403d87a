"""One ``tune`` run: the engine (started, given, or a server per configuration), the study opened and prepared, and
the objective's runner over one run context (capacity: tuner/commands/capacity_run.py; goodput:
tuner/commands/goodput_run.py); ``--apply`` leaves the tuned knobs in the engine, otherwise a given engine gets its
original config back."""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from engine.knobs import short_knobs
from policies import Policy
from tuner.commands.goodput_run import GoodputRun
from tuner.commands.progress import PROG, say
from tuner.commands.run_context import RunContext
from tuner.measure.measurement import Draws
from tuner.search.study import enqueue_default, open_study, recover_orphans, study_name_for
from tuner.search.trial_record import StudyRecord, design_seed_attrs, stamp, study_attrs
from tuner.trials.engine_handle import ConfigRejected, EngineError, EngineHandle, ManagedEngine
from tuner.trials.engine_kinds import ServerKind
from tuner.trials.restarted_engine import RestartedEngine
from tuner.trials.trial_runner import TrialRunner

if TYPE_CHECKING:
    from tuner.commands.capacity_run import CapacityRun


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
        self.applied = False
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
        self.prepare(study, model)
        context = self.context()
        try:
            return self.objective_run(context, runner, study, model).run()
        except EngineError as error:
            print(f"{PROG}: error: {error}", file=sys.stderr)
            return 1
        finally:
            self.applied = context.applied  # an engine the tuned config was applied to keeps it on the way out

    def context(self) -> RunContext:
        """What the objective's runner needs of this run."""
        return RunContext(self.policy, self.study_name, self.storage_url(), self.out, self.trials_dir, self.started,
                          self.draws, self.design_seed, getattr(self.args, "screen", None),
                          bool(getattr(self.args, "apply", False)), self.handle, self.kind, self.restarted)

    def storage_url(self) -> str:
        return str(getattr(self.storage, "url", type(self.storage).__name__))

    def prepare(self, study: optuna.Study, model: str | None) -> None:
        """The study's record of what it tunes (a resumed study's design seed kept), its trials left by a run that
        died marked failed, and the default config enqueued first."""
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

    def objective_run(self, context: RunContext, runner: TrialRunner, study: optuna.Study,
                      model: str | None) -> CapacityRun | GoodputRun:
        """The objective's runner: capacity per config and the paired verdict (the default), or goodput at a rate."""
        if self.policy.objective == "capacity":
            # imported here: it loads the simulator (the engine's scheduler), which the goodput objective never needs
            from tuner.commands.capacity_run import CapacityRun

            return CapacityRun(context, runner, study, model)
        return GoodputRun(context, runner, study, model)
