"""Locust entry point of slotune's load generator: ``locust -f loadtest/locustfile.py`` (web UI) or headless
through ``slotune loadtest``.

The load is the schedule, not Locust's user count. When a test starts, the master (or the single local process)
builds the schedule from the options (the ``slotune`` group of flags, also ``SLOTUNE_*`` environment variables
and fields of the web UI's start form), picks a start time a moment ahead, and gives each load process its share:
with N workers, worker rank r of N sends the requests with ``index % N == r``. Every load process runs one
open-loop dispatcher (:mod:`loadtest.openloop`) that sends each request at its intended time in its own greenlet
and streams its tokens; records flow back to the master, which writes ``records.parquet`` and ``summary.json``
into ``--out`` when every share is done (headless: then quits; web UI: stops the test).

The user class below does nothing: set users to 1 (any number gives the same load).
Environment: ``SLOTUNE_PROGRESS=json`` prints machine-readable progress lines on stdout (used by
``slotune loadtest``); by default progress is logged every 5 s.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import time
import urllib.request
from typing import Any

import gevent
from locust import User, constant, events, task
from locust.runners import STATE_MISSING, MasterRunner, WorkerRunner

from loadtest.config import OPTIONS, LoadConfig
from loadtest.openloop import OpenLoopDispatcher
from loadtest.records import RequestRecord, write_records
from loadtest.schedule import build_schedule
from loadtest.summary import format_summary_table, summarize, write_summary
from loadtest.tokens import TokenSpace
from loadtest.workloads import RequestSpec
from slotune import result_files as files

log = logging.getLogger("slotune.loadtest")
START_LEAD_S = 1.0  # the schedule starts this long after the plan is sent, so every process is ready
FLUSH_INTERVAL_S = 1.0  # how often workers send their finished records to the master
PROGRESS = os.environ.get("SLOTUNE_PROGRESS", "log")  # json | log | none


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    for o in OPTIONS:
        parser.add_argument(f"--{o.flag}", type=str, default=o.default, env_var=o.env,
                            help=f"[slotune] {o.help}", include_in_web_ui=True)


class OpenLoopUser(User):
    """Placeholder: the dispatcher, not the users, sends the requests (see the module docstring)."""

    wait_time = constant(3600)

    @task
    def idle(self) -> None:
        pass


# ------------------------------------------------------------------------------------------- load processes

class LoadProcess:
    """One process's part: run its dispatcher, pass records on (to the collector, or to the master)."""

    def __init__(self, environment: Any, plan: dict) -> None:
        self.env = environment
        self.rank = plan["rank"]
        self.pending: list[dict] = []
        self.final_sent = False
        cfg = LoadConfig.from_dict(plan["config"])
        share = [RequestSpec.from_wire(w) for w in plan["requests"]]
        self.dispatcher = OpenLoopDispatcher(
            share, plan["t0"], cfg.url, rank=self.rank, run_id=plan["run_id"], model=plan.get("model"),
            tokens=TokenSpace.parse_range(cfg.token_range, cfg.seed), request_timeout=cfg.request_timeout,
            drain_timeout=cfg.drain_timeout, on_record=self._on_record, on_finished=self._on_finished)
        self.collector: Collector | None = None  # set in local mode
        self._flusher = None

    def start(self) -> None:
        # Locust, Flask and friends leave ~60k long-lived objects; a full garbage collection walks them all and
        # stalls the event loop for tens of milliseconds (measured: ~55 ms), so move them out of the collector's
        # sight. What the run creates stays collectable.
        gc.collect()
        gc.freeze()
        self.dispatcher.start()
        if isinstance(self.env.runner, WorkerRunner):
            self._flusher = gevent.spawn(self._flush_loop)

    def _on_record(self, rec: RequestRecord) -> None:
        e2e_ms = ((rec.token_times[-1] if rec.token_times else rec.finish_time) - rec.intended_send_time) * 1000
        exc = None if rec.status == "ok" else Exception(f"{rec.status}: {rec.error}")
        self.env.events.request.fire(request_type="POST", name="/v1/completions (e2e from intended send)",
                                     response_time=e2e_ms if e2e_ms == e2e_ms else 0, response_length=rec.output_tokens,
                                     exception=exc, context={})
        if rec.token_times:
            self.env.events.request.fire(request_type="TTFT", name="first token (from intended send)",
                                         response_time=rec.ttft * 1000, response_length=1, exception=None, context={})
        if self.collector is not None:
            self.collector.add(self.rank, [rec.to_dict()], final=False, stats=None)
        else:
            self.pending.append(rec.to_dict())

    def _on_finished(self) -> None:
        if self.collector is not None:
            self.collector.add(self.rank, [], final=True, stats=self.dispatcher.snapshot())
        else:
            self._flush(final=True)

    def _flush_loop(self) -> None:
        while not self.final_sent:
            gevent.sleep(FLUSH_INTERVAL_S)
            if not self.final_sent:
                self._flush(final=False)

    def _flush(self, final: bool) -> None:
        if self.final_sent:
            return
        batch, self.pending = self.pending, []
        self.final_sent = final
        self.env.runner.send_message("slotune_records", {"rank": self.rank, "records": batch, "final": final,
                                                         "stats": self.dispatcher.snapshot()})

    def stop(self) -> None:
        self.dispatcher.stop()


# ------------------------------------------------------------------------------------------- collector

class Collector:
    """On the master (or the local process): the run's plan, all records, the progress line and the outputs."""

    def __init__(self, environment: Any, cfg: LoadConfig, ranks: int) -> None:
        self.env = environment
        self.cfg = cfg
        self.ranks = ranks
        self.schedule = build_schedule(cfg)
        self.run_id = time.strftime("%Y%m%d-%H%M%S-") + os.urandom(2).hex()  # request ids: <run_id>-<index>
        self.out = cfg.out or os.path.join("loadtest-results", self.run_id)
        self.model = cfg.model or discover_model(cfg.url)
        self.records: dict[int, dict] = {}
        self.duplicates = 0
        self.final: set[int] = set()
        self.stats: dict[int, dict] = {}
        self.done = False
        self.stopped_at: float | None = None
        self.t0 = 0.0
        self._progress = None

    def plans(self) -> list[dict]:
        self.t0 = time.time() + START_LEAD_S + len(self.schedule) / 100_000  # big plans take a moment to travel
        base = {"t0": self.t0, "run_id": self.run_id, "model": self.model, "config": self.cfg.to_dict(),
                "ranks": self.ranks}
        return [{**base, "rank": r, "requests": [s.to_wire() for s in self.schedule.share(r, self.ranks)]}
                for r in range(self.ranks)]

    def start_progress(self) -> None:
        self._progress = gevent.spawn(self._progress_loop)

    def add(self, rank: int, records: list[dict], final: bool, stats: dict | None) -> None:
        for d in records:
            # tuples of floats (and then the dict) drop out of the garbage collector's tracking, so thousands of
            # kept records don't lengthen collections in the process that also times the requests
            d["token_times"] = tuple(d["token_times"])
            if d["index"] in self.records:
                self.duplicates += 1
            self.records[d["index"]] = d
        if stats is not None:
            self.stats[rank] = stats
        if final:
            self.final.add(rank)
            if len(self.final) == self.ranks and not self.done:
                gevent.spawn(self.finish)

    def progress(self) -> dict:
        agg: dict[str, Any] = {"elapsed_s": time.time() - self.t0, "duration_s": self.schedule.duration_s,
                               "scheduled": len(self.schedule), "received": len(self.records)}
        for k in ("due", "sent", "in_flight", "ok", "failed", "tokens"):
            agg[k] = sum(s.get(k, 0) for s in self.stats.values())
        lags = [s["lag_p99"] for s in self.stats.values() if s.get("lag_p99") is not None]
        agg["lag_p99"] = max(lags) if lags else None
        agg["lag_max"] = max((s.get("lag_max", 0.0) for s in self.stats.values()), default=0.0)
        return agg

    def _progress_loop(self) -> None:
        last_log = 0.0
        while not self.done:
            gevent.sleep(1.0)
            local = getattr(self.env, "slotune_process", None)
            if local is not None:
                self.stats[local.rank] = local.dispatcher.snapshot()
            p = self.progress()
            if PROGRESS == "json":
                print("SLOTUNE_PROGRESS " + json.dumps(p), flush=True)
            elif PROGRESS == "log" and time.time() - last_log >= 5:
                last_log = time.time()
                log.info("slotune: %.0f/%.0fs sent %d/%d, %d in flight, %d ok, %d failed, lag p99 %s",
                         p["elapsed_s"], p["duration_s"], p["sent"], p["scheduled"], p["in_flight"], p["ok"],
                         p["failed"], "-" if p["lag_p99"] is None else f"{p['lag_p99'] * 1000:.1f}ms")

    def finish(self) -> None:
        """Write the records and the summary (once), then end the test."""
        if self.done:
            return
        self.done = True
        recs = [RequestRecord.from_dict(d) for d in self.records.values()]
        meta = {**self.schedule.meta, "url": self.cfg.url, "model": self.model, "workers": self.ranks, "out": self.out,
                "run_id": self.run_id, "start_time": self.t0, "records_received": len(recs),
                "duplicate_records": self.duplicates}
        duration = self.schedule.duration_s
        if self.stopped_at is not None and self.stopped_at - self.t0 < duration:
            meta["stopped_early"] = True
            duration = max(self.stopped_at - self.t0, 1e-9)
        # every request that was due by the end has a record (sent or not); one without is lost (a dead worker)
        due_by = self.stopped_at - self.t0 if self.stopped_at is not None and meta.get("stopped_early") else math.inf
        lost = sum(1 for r in self.schedule.requests if r.at <= due_by and r.index not in self.records)
        meta["lost_requests"] = lost
        summary = summarize(recs, self.cfg.slo, duration_s=duration, meta=meta, lag_warn=self.cfg.lag_warn)
        if lost:
            summary["warnings"].append(f"{lost} scheduled requests have no record")
        os.makedirs(self.out, exist_ok=True)
        ext = "csv" if self.cfg.records_format == "csv" else "parquet"
        write_records(os.path.join(self.out, f"records.{ext}"), recs, meta=meta)
        write_summary(os.path.join(self.out, files.SUMMARY), summary)
        if PROGRESS == "json":
            print("SLOTUNE_DONE " + json.dumps({"out": self.out}), flush=True)
        else:
            log.info("slotune: wrote %s/records.%s and summary.json\n%s", self.out, ext, format_summary_table(summary))
        runner = self.env.runner
        if self.env.parsed_options is not None and getattr(self.env.parsed_options, "headless", False):
            self.env.process_exit_code = 0
            gevent.spawn(runner.quit)
        elif runner.state not in ("stopped", "stopping"):
            gevent.spawn(runner.stop)


def discover_model(url: str, timeout: float = 3.0) -> str | None:
    """The first model id of ``GET /v1/models``, or None."""
    base = url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=timeout) as r:
            data = json.loads(r.read())
        return data["data"][0]["id"]
    except Exception:  # any failure means: send no model name
        return None


# ------------------------------------------------------------------------------------------- wiring

def _config(environment: Any) -> LoadConfig:
    opts = vars(environment.parsed_options) if environment.parsed_options else {}
    return LoadConfig.from_strings(opts, url=environment.host or None)


@events.init.add_listener
def _on_init(environment: Any, **_: Any) -> None:
    runner = environment.runner
    if isinstance(runner, MasterRunner):
        runner.register_message("slotune_records", _on_records_message)
    elif isinstance(runner, WorkerRunner):
        runner.register_message("slotune_plan", _on_plan_message, concurrent=True)
        runner.register_message("slotune_stop", _on_stop_message, concurrent=True)


def _on_records_message(environment: Any, msg: Any) -> None:
    collector = getattr(environment, "slotune_collector", None)
    if collector is not None and not collector.done:
        d = msg.data
        collector.add(d["rank"], d["records"], d["final"], d.get("stats"))


def _on_plan_message(environment: Any, msg: Any) -> None:
    old = getattr(environment, "slotune_process", None)
    if old is not None:
        old.stop()
    proc = LoadProcess(environment, msg.data)
    environment.slotune_process = proc
    proc.start()


def _on_stop_message(environment: Any, msg: Any) -> None:
    proc = getattr(environment, "slotune_process", None)
    if proc is not None:
        proc.stop()


@events.test_start.add_listener
def _on_test_start(environment: Any, **_: Any) -> None:
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        return  # workers start on the master's plan
    try:
        cfg = _config(environment)
        if isinstance(runner, MasterRunner):
            clients = sorted(c.id for c in runner.clients.all if c.state != STATE_MISSING)
            collector = Collector(environment, cfg, max(1, len(clients)))
            environment.slotune_collector = collector
            for client_id, plan in zip(clients, collector.plans()):
                runner.send_message("slotune_plan", plan, client_id=client_id)
        else:
            collector = Collector(environment, cfg, 1)
            environment.slotune_collector = collector
            proc = LoadProcess(environment, collector.plans()[0])
            proc.collector = collector
            environment.slotune_process = proc
            proc.start()
        collector.start_progress()
        log.info("slotune: %d requests over %.1fs to %s (%d load process(es)) -> %s", len(collector.schedule),
                 collector.schedule.duration_s, cfg.url, collector.ranks, collector.out)
    except Exception as e:  # a bad option: say so and end the test rather than run without load
        log.error("slotune: cannot start the load test: %s", e)
        print(f"SLOTUNE_ERROR {json.dumps(str(e))}", flush=True)
        environment.process_exit_code = 2
        if environment.parsed_options is not None and getattr(environment.parsed_options, "headless", False):
            gevent.spawn(runner.quit)
        else:
            gevent.spawn(runner.stop)


@events.test_stop.add_listener
def _on_test_stop(environment: Any, **_: Any) -> None:
    """A stop before the schedule's end (web UI button, Ctrl-C, SIGTERM): collect what there is and write it."""
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        proc = getattr(environment, "slotune_process", None)
        if proc is not None:
            proc.stop()
        return
    collector = getattr(environment, "slotune_collector", None)
    if collector is None or collector.done:
        return
    collector.stopped_at = time.time()
    if isinstance(runner, MasterRunner):
        runner.send_message("slotune_stop", None)
        deadline = time.time() + 10
        while len(collector.final) < collector.ranks and time.time() < deadline:
            gevent.sleep(0.1)
    else:
        proc = getattr(environment, "slotune_process", None)
        if proc is not None:
            proc.stop()
    collector.finish()
