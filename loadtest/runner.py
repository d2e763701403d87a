"""Runs a load test in Locust processes of its own, headless, and returns the summary.

This module does not import locust (nor gevent): it starts ``python -m locust -f loadtest/locustfile.py``
(one local process, or a master and N workers on this machine), relays the master's progress lines, waits for
``summary.json`` and ``records.parquet`` to appear in the output directory, and cleans up the processes.
The tuner may call :func:`run_loadtest` directly, or run ``slotune loadtest`` as a subprocess.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import IO, Callable

from loadtest.config import OPTIONS, LoadConfig, to_argv
from loadtest.schedule import build_schedule
from slotune import result_files as files

LOCUSTFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "locustfile.py")
STARTUP_ALLOWANCE_S = 60.0  # Locust start-up, workers connecting, the plan going out
_PR_SET_PDEATHSIG = 1
REALTIME_PRIORITY = 10  # SCHED_RR priority of the load processes with realtime=True (1..99; low among RT tasks)


class LoadTestError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {o.env for o in OPTIONS}}  # flags only, no surprises
    env.update(SLOTUNE_PROGRESS="json", PYTHONUNBUFFERED="1")
    return env


def locust_commands(cfg: LoadConfig, workers: int, port: int | None = None) -> tuple[list[str], list[list[str]]]:
    """The master (or single local process) command line and the worker command lines."""
    base = [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--exit-code-on-error", "0", "--loglevel", "INFO"]
    main = base + ["--headless", "--only-summary", "-u", "1", "-r", "1", "--host", cfg.url, *to_argv(cfg)]
    if workers <= 1:
        return main, []
    port = port or free_port()
    main += ["--master", "--expect-workers", str(workers), "--master-bind-host", "127.0.0.1",
             "--master-bind-port", str(port)]
    worker = base + ["--worker", "--master-host", "127.0.0.1", "--master-port", str(port)]
    return main, [list(worker) for _ in range(workers)]


def stop_process(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; a process that already ended is left alone."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    except ProcessLookupError:
        pass


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux prctl PR_SET_PDEATHSIG), so a load process
    started in a session of its own does not outlive a parent killed by SIGKILL."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _priority(nice: int, realtime: bool, cpus: tuple[int, ...] | None = None) -> Callable[[], None]:
    """What a load process does before exec: die with its parent; keep to ``cpus`` (if given); lower its niceness
    and/or take a real-time (SCHED_RR) priority. Without the privilege it keeps the normal priority (the summary
    says which it got)."""

    def apply() -> None:
        die_with_parent()
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)
            except (OSError, AttributeError):
                pass
        if nice:
            try:
                os.nice(nice)
            except OSError:
                pass
        if realtime:
            try:
                os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(REALTIME_PRIORITY))
            except (OSError, AttributeError):
                pass
    return apply


def _scheduling(pid: int) -> str:
    try:
        policy = os.sched_getscheduler(pid)
        nice = os.getpriority(os.PRIO_PROCESS, pid)
    except (OSError, AttributeError):
        return "unknown"
    name = {getattr(os, "SCHED_RR", -1): "SCHED_RR", getattr(os, "SCHED_FIFO", -2): "SCHED_FIFO"}.get(policy)
    return f"{name} priority {os.sched_getparam(pid).sched_priority}" if name else f"normal, nice {nice}"


def run_loadtest(cfg: LoadConfig, workers: int = 1, on_progress: Callable[[dict], None] | None = None,
                 timeout: float | None = None, nice: int = 0, realtime: bool = False,
                 cpus: tuple[int, ...] | None = None) -> dict:
    """Run the load test described by ``cfg`` with ``workers`` load processes; return the summary dict.

    ``realtime`` (SCHED_RR) or a negative ``nice`` (both need the privilege) let the generator keep its schedule
    when the server under test, or anything else, saturates this machine's CPUs: the generator uses little CPU
    but needs it at the right moments. Niceness only counts against processes of the same cgroup; a real-time
    priority counts against all ordinary processes.

    Writes ``<out>/records.parquet`` (or ``.csv``), ``<out>/summary.json`` and the Locust logs
    (``<out>/locust*.log``). Raises LoadTestError when no summary was produced."""
    if workers < 1:
        raise ValueError("workers must be >= 1")
    schedule = build_schedule(cfg)  # fail early on bad options, and size the timeout
    cfg = _fresh_output(cfg)
    assert cfg.out is not None
    if timeout is None:
        timeout = STARTUP_ALLOWANCE_S + schedule.duration_s + cfg.drain_timeout + 30.0
    scheduling, errors = _run_locust(cfg, workers, on_progress, timeout, _priority(nice, realtime, cpus))
    return _finish_summary(cfg.out, scheduling, errors)


def _fresh_output(cfg: LoadConfig) -> LoadConfig:
    """``cfg`` with its output directory made absolute (default: a new one under loadtest-results), created, and
    cleared of an earlier run's summary and records."""
    out = os.path.abspath(cfg.out or os.path.join("loadtest-results", time.strftime("%Y%m%d-%H%M%S")))
    os.makedirs(out, exist_ok=True)
    for name in (files.SUMMARY, files.RECORDS, files.RECORDS_CSV):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    return replace(cfg, out=out)


def _run_locust(cfg: LoadConfig, workers: int, on_progress: Callable[[dict], None] | None, timeout: float,
                preexec: Callable[[], None]) -> tuple[str, list[str]]:
    """Run the Locust master (or single process) and its workers to the end; returns the master's scheduling
    and the errors it reported (or that stopped it)."""
    assert cfg.out is not None
    main_cmd, worker_cmds = locust_commands(cfg, workers)
    env = _child_env()
    procs: list[subprocess.Popen] = []
    scheduling = "unknown"
    logs = []
    errors: list[str] = []
    try:
        main_log = open(os.path.join(cfg.out, "locust.log"), "w")
        logs.append(main_log)
        # a session of their own: Ctrl-C reaches only us, and we stop Locust cleanly
        main = subprocess.Popen(main_cmd, stdout=subprocess.PIPE, stderr=main_log, env=env, text=True,
                                start_new_session=True, preexec_fn=preexec)
        procs.append(main)
        for i, cmd in enumerate(worker_cmds):
            wlog = open(os.path.join(cfg.out, f"locust-worker-{i}.log"), "w")
            logs.append(wlog)
            procs.append(subprocess.Popen(cmd, stdout=wlog, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True, preexec_fn=preexec))
        scheduling = _scheduling(main.pid)
        reader = threading.Thread(target=_relay, args=(main, main_log, on_progress, errors), daemon=True)
        reader.start()
        try:
            main.wait(timeout)
        except subprocess.TimeoutExpired:
            errors.append(f"the load test did not finish within {timeout:.0f}s")
            stop_process(main, 20.0)
        except KeyboardInterrupt:
            stop_process(main, 20.0)  # SIGTERM: Locust stops, and the locustfile writes what it has
            errors.append("interrupted")
        reader.join(5)
    finally:
        for p in procs[1:]:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                stop_process(p, 5.0)
        for p in procs[:1]:
            stop_process(p, 5.0)
        for f in logs:
            f.close()
    return scheduling, errors


def _relay(main: subprocess.Popen, main_log: IO[str], on_progress: Callable[[dict], None] | None,
           errors: list[str]) -> None:
    """The master's output: progress lines to ``on_progress``, error lines to ``errors``, the rest to its log."""
    assert main.stdout is not None
    for line in main.stdout:
        if line.startswith("SLOTUNE_PROGRESS "):
            if on_progress is not None:
                try:
                    on_progress(json.loads(line.split(" ", 1)[1]))
                except Exception:  # progress display must never break a run
                    pass
        elif line.startswith("SLOTUNE_ERROR "):
            errors.append(json.loads(line.split(" ", 1)[1]))
        else:
            main_log.write(line)
    main_log.flush()


def _finish_summary(out: str, scheduling: str, errors: list[str]) -> dict:
    """The summary the run wrote, with the load processes' scheduling and the run's errors added (and written
    back). Raises LoadTestError, with the log's tail, when there is none."""
    summary_path = os.path.join(out, files.SUMMARY)
    if not os.path.exists(summary_path):
        log_path = os.path.join(out, "locust.log")
        tail = ""
        if os.path.exists(log_path):
            with open(log_path) as f:
                tail = "".join(f.readlines()[-20:])
        reason = "; ".join(errors) or "no summary written"
        raise LoadTestError(f"{reason} (see {log_path})" + ("\n" + tail if tail else ""))
    with open(summary_path) as f:
        summary = json.load(f)
    summary["load_process_scheduling"] = scheduling
    if errors:
        summary.setdefault("warnings", []).extend(errors)
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    return summary
