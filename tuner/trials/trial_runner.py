"""One trial on a live engine: wait until it is idle, apply the knobs (PATCH /admin/config), replay the workload
(warm-up + measurement window) in Locust subprocesses, summarize the window from the records, attach the engine's
step statistics, and write the trial folder:

    records.parquet  the load test's records (warm-up included; the summary's ``window`` says what counts)
    summary.json     loadtest.summary.summarize over the window
    steps.jsonl      the engine's step records that made the window's tokens: from the window's opening to the end
                     of the load test, its drain included (StepRecord.to_dict(), one per line; step_stats.window_steps),
                     read while the load test runs (tuner/trials/step_collector.py); records the engine's ring buffer
                     dropped before they were read are counted in step_stats' ``steps_dropped``
    trial.json       {"format": "slotune-trial/1", knobs, step_stats, feasible, reason, workload, rate, slo,
                      started_at, simulated}

A rejected config (422), a load test that fails or times out, and an engine that dies are infeasible trials with
their reason (a dead engine this tuner started is restarted). A window in which other processes on the machine took
more than a quarter of a core is one too, its reason "the machine was busy ..." (tuner/trials/host_load.py): the
measurement runs it again rather than count it against the config. A trial whose p99 TBT is clearly lost is stopped
early (pruned) and recorded as infeasible. The engine is reached only over HTTP; locust is never imported here.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import psutil

from loadtest.config import LoadConfig
from loadtest.runner import LOCUSTFILE, LoadTestError, run_loadtest
from slotune.slo import SLO
from loadtest.summary import summarize, write_summary
from policies import PruningSpec, WorkloadSpec
from tuner.trials.engine_handle import ConfigRejected, EngineError, EngineHandle, ManagedEngine
from tuner.trials.restarted_engine import RestartedEngine, StartFailed
from tuner.trials.host_load import BUSY_CORES, HostLoad, busy_reason, is_local, serving_pid
from tuner.trials.engine_metrics import engine_itl_p99
from tuner.trials.step_collector import STEP_POLL_S, StepCollector
from tuner.trials.pruning import PruneWatcher
from tuner.trials.step_stats import step_stats, window_steps
from tuner.trials.trial_backend import load_config_for
from slotune import result_files as files

__all__ = ["TrialOutcome", "TrialRunner", "step_stats", "TRIAL_FORMAT", "feasibility"]

TRIAL_FORMAT = "slotune-trial/1"
WARMUP_SEED = 2_147_483_629  # the arrivals of a fresh server's warm-up: a draw no measured window is given

# Set by tune's SIGINT/SIGTERM handler. The handler also raises KeyboardInterrupt, but an exception raised in a
# signal handler can be swallowed (e.g. inside a fork hook); the flag is checked between the steps of a trial.
STOP = threading.Event()


def check_stop() -> None:
    if STOP.is_set():
        raise KeyboardInterrupt


@dataclass
class TrialOutcome:
    knobs: dict[str, Any]          # every knob applied (full config, not only the searched ones)
    summary: dict[str, Any]        # the loadtest summary dict (loadtest.summary.summarize), empty if none
    step_stats: dict[str, float]   # see tuner.trials.step_stats.STEP_STATS_KEYS
    feasible: bool
    reason: str | None             # why infeasible / failed (None when feasible)
    out_dir: Path | None
    simulated: bool = False
    pruned: bool = False
    rate: float | None = None


def feasibility(summary: dict[str, Any], slo: SLO) -> str | None:
    """None when the window's summary meets every SLO target, else why not."""
    if not summary.get("requests"):
        return "no requests in the measurement window"
    if not summary.get("completed"):
        return "no request completed"
    for key, target, name in (("tbt_p99", slo.tbt_p99, "p99 TBT"), ("ttft_p99", slo.ttft_p99, "p99 TTFT"),
                              ("e2e_p99", slo.e2e_p99, "p99 E2E")):
        if target is None:
            continue
        value = summary.get(key)
        if value is None or value > target:
            shown = "-" if value is None else f"{value * 1000:.0f}ms"
            return f"{name} {shown} > {target * 1000:g}ms"
    return None


@dataclass
class TrialRunner:
    """Runs trials against ``engine``: an EngineHandle (knobs changed live), a ManagedEngine this tuner owns and may
    restart, or a RestartedEngine (a server per configuration, the knobs as its start-up flags)."""

    engine: EngineHandle | ManagedEngine | RestartedEngine
    workload: WorkloadSpec = field(default_factory=lambda: WorkloadSpec(name="mixed"))  # or a name (made a record)
    rate: float = 1.0
    duration: float = 20.0
    warmup: float = 3.0
    slo: SLO = field(default_factory=lambda: SLO(tbt_p99=0.05))
    pruning: PruningSpec | None = None
    seed: int = 0
    drain_timeout: float = 10.0
    idle_timeout: float = 60.0
    realtime: bool = True  # the load generator keeps its schedule while the engine saturates the CPUs
    generator_cpus: tuple[int, ...] | None = None  # keep the load generator to these cores (tuner/measure/floor.py)
    base_knobs: dict[str, Any] | None = None  # the config a trial's knobs are laid over (default: the engine's now)
    step_poll_s: float | None = STEP_POLL_S  # read the step records this often during the load test (None: after it)
    on_progress: Callable[[dict[str, Any]], None] | None = None
    busy_cores: float | None = BUSY_CORES  # other processes' CPU that voids a window (None: recorded, not judged)
    server_warmup: float = 0.0  # seconds of load on each fresh server of a RestartedEngine before it is measured

    def __post_init__(self) -> None:
        self.workload = WorkloadSpec.of(self.workload)
        if not isinstance(self.slo, SLO):
            raise TypeError(f"slo must be a slotune.slo.SLO record, got {type(self.slo).__name__}")
        if self.base_knobs is None:
            self.base_knobs = self.engine.defaults() if isinstance(self.engine, RestartedEngine) \
                else self.handle.get_config()

    @property
    def handle(self) -> EngineHandle:
        if isinstance(self.engine, (ManagedEngine, RestartedEngine)):
            if self.engine.handle is None:
                raise RuntimeError("the engine is not started: start it before running trials")
            return self.engine.handle
        return self.engine

    simulated = False

    def load_config(self, rate: float, out_dir: Path, seed: int | None, duration: float) -> LoadConfig:
        return load_config_for(self.workload, self.slo, rate, self.warmup + duration,
                               self.seed if seed is None else seed, self.drain_timeout, url=self.handle.url,
                               out=str(out_dir))

    # ------------------------------------------------------------------------------------------------ trial

    def run(self, knobs: dict[str, Any], out_dir: Path, rate: float | None = None, seed: int | None = None,
            prune: bool = False, duration: float | None = None) -> TrialOutcome:
        """Measure ``knobs`` (laid over the base config) at ``rate`` (default: the runner's) on arrival draw ``seed``
        (default: the runner's) in a window of ``duration`` seconds (default: the runner's); ``prune=True`` stops a
        window whose p99 TBT is already lost (goodput objective)."""
        rate = self.rate if rate is None else rate
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in (files.SUMMARY, files.STEPS, files.TRIAL):  # a folder reused: no stale results
            (out_dir / name).unlink(missing_ok=True)
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        full = {**(self.base_knobs or {}), **knobs}
        outcome = self._run(full, out_dir, rate, prune, seed, duration or self.duration)
        self._write_trial(outcome, out_dir, started_at)
        return outcome

    def _fail(self, knobs: dict[str, Any], out_dir: Path, rate: float, reason: str,
              summary: dict[str, Any] | None = None) -> TrialOutcome:
        return TrialOutcome(knobs=knobs, summary=summary or {}, step_stats=step_stats([]), feasible=False,
                            reason=reason, out_dir=out_dir, rate=rate)

    def _ensure_engine(self) -> str | None:
        """Restart a dead engine this tuner owns; returns what happened (None: it was alive)."""
        if isinstance(self.engine, RestartedEngine):  # the next trial's apply starts the server it needs
            if self.engine.process is None or self.engine.alive():
                return None
            self.engine.stop()
            return "the engine had died; the next trial starts a fresh server"
        if self.handle.alive():
            return None
        if isinstance(self.engine, ManagedEngine):
            self.engine.restart()
            return "the engine had died and was restarted"
        # someone else's engine: give it a moment (it may be restarting), else give up the study
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(1)
            if self.handle.alive():
                return None
        raise EngineError(f"the engine at {self.handle.url} is not answering /health")

    def _run(self, knobs: dict[str, Any], out_dir: Path, rate: float, prune: bool,
             seed: int | None, duration: float) -> TrialOutcome:
        check_stop()
        self._ensure_engine()
        try:
            knobs, first_step = self._apply(knobs, rate)
        except _NotMeasured as failed:
            return self._fail(failed.knobs, out_dir, rate, failed.reason)
        cfg = self.load_config(rate, out_dir, seed, duration)
        collector = StepCollector(self.handle, first_step, self.step_poll_s)
        watch = _LoadWatch(self, collector, PruneWatcher(self.slo.tbt_p99, self.pruning, duration)
                           if prune and self.pruning is not None and self.pruning.enabled and self.slo.tbt_p99
                           else None, {"knobs": knobs, "rate": rate, "warmup": self.warmup})
        load_error = None
        host = self._host_load().start()
        try:
            run_summary = run_loadtest(cfg, on_progress=watch, realtime=self.realtime, cpus=self.generator_cpus,
                                       timeout=60.0 + cfg.duration + self.drain_timeout + 30.0)
        except LoadTestError as error:
            load_error = str(error).splitlines()[0]
            run_summary = None
        watch.host = host.stop()
        if run_summary is not None and "interrupted" in run_summary.get("warnings", []):
            raise KeyboardInterrupt  # the runner stopped Locust on Ctrl-C; the study must stop too
        watch.ended_at = time.time()  # wall clock, as the step records' start times
        check_stop()
        itl_end = self._itl_snapshot()
        engine_note = None
        try:
            engine_note = self._ensure_engine()
        except EngineError as error:
            engine_note = str(error)
        if engine_note is not None:
            return self._fail(knobs, out_dir, rate, f"engine crashed during the trial ({engine_note})"
                              + (f"; load test: {load_error}" if load_error else ""))
        if run_summary is None:
            return self._fail(knobs, out_dir, rate, f"load test failed: {load_error}")
        return self._measure(knobs, out_dir, rate, cfg, run_summary, watch, itl_end, duration)

    def _host_load(self) -> HostLoad:
        """Other processes' CPU during the load test, this tuner's engine counted as its own: a child when tune
        started it, else the process serving its URL's port on this machine (not judged where none is found
        there; a remote engine's CPU is not this machine's)."""
        if isinstance(self.engine, (ManagedEngine, RestartedEngine)):
            return HostLoad()
        pid = serving_pid(self.handle.url)
        return HostLoad(judged=pid is not None or not is_local(self.handle.url), also=(pid,) if pid is not None else ())

    def _apply(self, knobs: dict[str, Any], rate: float) -> tuple[dict[str, Any], int]:
        """Apply ``knobs`` to the idle engine from a cleared prefix cache (a fresh server warmed at ``rate`` first);
        returns the knobs as applied and the step to read the engine's step records on from. Raises _NotMeasured
        when it cannot."""
        if isinstance(self.engine, RestartedEngine):
            try:  # the server of this config: the running one, or a new one started with its flags
                knobs = self.engine.apply(knobs)
            except StartFailed as error:
                raise _NotMeasured(knobs, f"rejected by the engine at start-up: {error}") from None
            except ConfigRejected as error:
                raise _NotMeasured(knobs, f"rejected by the engine: {error}") from None
            except EngineError as error:
                raise _NotMeasured(knobs, f"could not start the engine: {error}") from None
            if self.engine.cold:
                self._warm_server(rate)
        if not self.handle.wait_idle(self.idle_timeout):
            raise _NotMeasured(knobs, f"the engine did not become idle within {self.idle_timeout:.0f}s")
        # the step to read on from: taken while idle, before the config change and the reset (the window's steps
        # are then picked by their start times)
        first_step = int((self.handle.health() or {}).get("last_step", -1))
        if isinstance(self.engine, RestartedEngine):
            applied = dict(knobs)
        else:
            try:
                applied = dict(self.handle.patch_config(knobs))
            except ConfigRejected as error:
                raise _NotMeasured(knobs, f"rejected by the engine: {error}") from None
            except EngineError as error:
                raise _NotMeasured(knobs, f"could not apply the knobs: {error}") from None
        try:  # every trial starts from the same state: no prefix block of an earlier trial survives
            self.handle.reset_prefix_cache()
        except EngineError as error:
            raise _NotMeasured(applied, f"could not reset the prefix cache: {error}") from None
        return applied, first_step

    def _warm_server(self, rate: float) -> None:
        """Load a fresh server with the workload at ``rate`` for ``server_warmup`` seconds before its first window.
        Its first request of each shape builds kernels for it (vLLM's CPU build: the first prompt of a length takes
        about twice as long as the next), a start-up cost that would otherwise land on the first rate measured.
        The arrivals are a draw no window uses; the load test's records are kept beside the server's log."""
        if not isinstance(self.engine, RestartedEngine):
            raise TypeError("only a server started per config is warmed")
        t0 = time.monotonic()
        if self.server_warmup > 0:
            out = Path(self.engine.log_path).with_suffix(".warmup")
            cfg = load_config_for(self.workload, self.slo, rate, self.server_warmup, WARMUP_SEED, self.drain_timeout,
                                  url=self.handle.url, out=str(out))
            try:
                run_loadtest(cfg, realtime=self.realtime, cpus=self.generator_cpus,
                             timeout=60.0 + cfg.duration + self.drain_timeout + 30.0)
            except LoadTestError:
                pass  # the window's own load test meets and reports whatever failed here
        self.engine.warmed(time.monotonic() - t0)

    def _measure(self, knobs: dict[str, Any], out_dir: Path, rate: float, cfg: LoadConfig,
                 run_summary: dict[str, Any], watch: _LoadWatch,
                 itl_end: dict[float, float], duration: float) -> TrialOutcome:
        """The load test's window ([warmup, warmup + duration) of the schedule, cut short when pruned) summarized
        and written with the engine's step records of it, and judged."""
        end = min(self.warmup + duration, math.inf if watch.stopped_at is None else watch.stopped_at)
        records_path = out_dir / files.RECORDS
        summary = summarize(str(records_path), slo=self.slo, window=(self.warmup, max(end, self.warmup + 1e-3)),
                            meta={k: v for k, v in run_summary.items() if k != "warnings"},
                            lag_warn=cfg.lag_warn)
        summary["engine_itl_p99"] = engine_itl_p99(watch.itl_start or {}, itl_end)
        summary["host"] = watch.host
        write_summary(str(out_dir / files.SUMMARY), summary)
        t0 = float(run_summary.get("start_time") or 0.0)
        # the steps that made the window's tokens: from its opening to the load test's end (the drain included),
        # or to the moment the pruned load test was stopped
        start = t0 + self.warmup
        end_s = t0 + watch.stopped_at if watch.stopped_at is not None else watch.ended_at
        watch.collector.read()  # the drain's last steps
        steps = window_steps(watch.collector.records, start, end_s)
        with open(out_dir / files.STEPS, "w", encoding="utf-8") as f:
            for r in steps:
                f.write(json.dumps(r) + "\n")
        stats = step_stats(steps, dropped=watch.collector.dropped_in(start, end_s))
        busy = busy_reason(watch.host, self.busy_cores)
        if busy is not None:  # the window measured the machine, not the config
            return TrialOutcome(knobs, summary, stats, False, busy, out_dir, rate=rate)
        if watch.watcher is not None and watch.watcher.reason:
            return TrialOutcome(knobs, summary, stats, False, watch.watcher.reason, out_dir, pruned=True, rate=rate)
        reason = feasibility(summary, self.slo)
        return TrialOutcome(knobs, summary, stats, reason is None, reason, out_dir, rate=rate)

    def _itl_snapshot(self) -> dict[float, float]:
        try:
            return self.handle.itl_buckets()
        except EngineError:
            return {}

    def _write_trial(self, o: TrialOutcome, out_dir: Path, started_at: str) -> None:
        if not (out_dir / files.SUMMARY).exists():
            write_summary(str(out_dir / files.SUMMARY), o.summary)
        if not (out_dir / files.STEPS).exists():
            (out_dir / files.STEPS).write_text("")
        trial = {"format": TRIAL_FORMAT, "knobs": o.knobs, "step_stats": o.step_stats, "feasible": o.feasible,
                 "reason": o.reason, "workload": self.workload.as_dict(), "rate": o.rate, "slo": self.slo.as_dict(),
                 "started_at": started_at, "simulated": o.simulated, "pruned": o.pruned,
                 "duration": self.duration, "warmup": self.warmup}
        if isinstance(self.engine, RestartedEngine):  # which server measured it, and its log
            trial["engine"] = {"kind": self.engine.kind.name, "flags": self.engine.flags, "log": self.engine.log_path}
        (out_dir / files.TRIAL).write_text(json.dumps(trial, indent=2) + "\n")


class _NotMeasured(Exception):
    """A trial that ends before its load test, for ``reason``."""

    def __init__(self, knobs: dict[str, Any], reason: str) -> None:
        super().__init__(reason)
        self.knobs, self.reason = knobs, reason


class _LoadWatch:
    """A trial's load-test progress: handed on to the runner's ``on_progress``; the engine's inter-token histogram
    taken as the window opens; the step records read on as they are made; the load stopped when tune stops, or when ``watcher`` judges the window lost."""

    def __init__(self, runner: TrialRunner, collector: StepCollector, watcher: PruneWatcher | None,
                 context: dict[str, Any]) -> None:
        self.runner, self.collector, self.watcher = runner, collector, watcher
        self.context = context  # what is being measured, handed on with each progress report
        self.itl_start: dict[float, float] | None = None
        self.stopped_at: float | None = None  # seconds into the load test when the pruner stopped it
        self.ended_at = math.inf  # when the load test ended (wall clock)
        self.host: dict[str, float | bool] = {}  # what other processes took meanwhile (tuner/trials/host_load.py)

    def __call__(self, p: dict[str, Any]) -> None:
        runner = self.runner
        if runner.on_progress is not None:
            runner.on_progress({**p, **self.context})
        elapsed_s = float(p.get("elapsed_s", 0.0))
        if self.itl_start is None and elapsed_s >= runner.warmup:
            self.itl_start = runner._itl_snapshot()  # the engine's inter-token histogram as the window opens
        self.collector.poll()  # before the engine's ring buffer drops them
        if STOP.is_set():
            _stop_locust()  # tune is stopping: end the load test now
            return
        if self.watcher is None or self.stopped_at is not None:
            return
        elapsed = elapsed_s - runner.warmup
        if elapsed < 0:
            return
        if self.watcher.check(elapsed, runner.handle.itl_buckets()):
            self.stopped_at = elapsed_s
            _stop_locust()


def _stop_locust() -> None:
    """SIGTERM the Locust processes this process started (the runner then collects what they wrote)."""
    for child in psutil.Process(os.getpid()).children(recursive=False):
        try:
            if LOCUSTFILE in " ".join(child.cmdline()):
                child.send_signal(signal.SIGTERM)
        except (psutil.Error, OSError):
            pass
