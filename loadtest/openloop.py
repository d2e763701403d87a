"""The open-loop dispatcher: sends each request of its share of the schedule at the request's intended time,
each in its own greenlet, never waiting for earlier requests; measures its own lateness.

Runs inside a load process (gevent; imported by the locustfile and the capacity benchmark only). It does not
import locust: the locustfile wires its callbacks to Locust's events and master/worker messages.

Clock: every process maps ``time.perf_counter()`` to Unix time once (an offset taken when the dispatcher is
created), so intended and actual send times and token times are epoch seconds from one monotonic clock, comparable
across the processes of one machine (and across machines up to their clock sync).
"""

from __future__ import annotations

import json
import math
import time
from typing import Callable

import gevent
from gevent import GreenletExit

from loadtest.records import RequestRecord
from loadtest.stream_client import Endpoint, StreamResult, stream_completion
from loadtest.tokens import PromptBuilder, TokenSpace
from loadtest.workloads import RequestSpec

SPIN_S = 0.0015  # the last stretch before a send is due is spent yielding rather than on a timer (see _wait_until)


class RequestTimeout(Exception):
    """Raised into a request's greenlet by the watchdog."""


def epoch_offset(samples: int = 5) -> float:
    """``time.time() - time.perf_counter()``, the sample with the tightest bracket."""
    best = None
    for _ in range(samples):
        a = time.perf_counter()
        wall = time.time()
        b = time.perf_counter()
        if best is None or b - a < best[0]:
            best = (b - a, wall - (a + b) / 2)
    assert best is not None
    return best[1]


def request_body(spec: RequestSpec, builder: PromptBuilder, model: str | None) -> bytes:
    body = {
        "prompt": builder.tokens(spec.segments, spec.prompt_len),
        "max_tokens": spec.output_len,
        "min_tokens": spec.output_len,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # vLLM lists each event's tokens: several in one event count as several
        "temperature": 0.0,
    }
    if model:
        body["model"] = model
    return json.dumps(body, separators=(",", ":")).encode()


class OpenLoopDispatcher:
    """Sends ``requests`` (sorted by ``at``) at ``t0_epoch + at``; calls ``on_record`` for each finished request
    and ``on_finished`` once, after the last one finished or the drain timeout cut the rest (``unfinished``)."""

    def __init__(self, requests: list[RequestSpec], t0_epoch: float, url: str, *, rank: int = 0,
                 run_id: str = "run", model: str | None = None, tokens: TokenSpace | None = None,
                 request_timeout: float = 120.0, drain_timeout: float = 60.0,
                 on_record: Callable[[RequestRecord], None] | None = None,
                 on_finished: Callable[[], None] | None = None) -> None:
        self.requests = sorted(requests, key=lambda r: (r.at, r.index))
        self.t0_epoch = t0_epoch
        self.rank = rank
        self.run_id = run_id
        self.model = model
        self.builder = PromptBuilder(tokens or TokenSpace())
        self.endpoint = Endpoint(url, timeout=request_timeout, io_timeout=False)  # the watchdog times requests out
        self.request_timeout = request_timeout
        self.drain_timeout = drain_timeout
        self.on_record = on_record or (lambda r: None)
        self.on_finished = on_finished or (lambda: None)
        self.offset = epoch_offset()
        self.t0 = t0_epoch - self.offset  # perf_counter time of the run's start
        self.next = 0  # index into self.requests of the next one to send
        self.inflight: dict[int, gevent.Greenlet] = {}
        self.results: dict[int, StreamResult] = {}
        self.finished = False
        self._loop: gevent.Greenlet | None = None
        self._watchdog: gevent.Greenlet | None = None
        # counters for progress reports
        self.sent = self.ok = self.failed = self.tokens = 0
        self.lags: list[float] = []  # send lags since the last progress snapshot
        self.max_lag = 0.0

    # -- control ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        try:
            self.endpoint.resolve()  # now rather than in the first request's send time
        except OSError:
            pass  # the requests will report it
        self._loop = gevent.spawn(self._run)
        self._watchdog = gevent.spawn(self._watch)

    def _watch(self) -> None:
        """Fail requests that received nothing for ``request_timeout``."""
        period = min(1.0, self.request_timeout / 4)
        while not self.finished:
            gevent.sleep(period)
            now = time.perf_counter()
            for index, res in list(self.results.items()):
                if now - res.last_activity > self.request_timeout and index in self.inflight:
                    self.inflight[index].kill(RequestTimeout, block=False)

    def stop(self) -> None:
        """End now: requests already due but not sent become ``not_sent``, requests in flight ``unfinished``."""
        if self.finished:
            return
        if self._loop is not None and self._loop is not gevent.getcurrent():
            self._loop.kill(block=True)
        now = time.perf_counter()
        while self.next < len(self.requests) and self.t0 + self.requests[self.next].at <= now:
            spec = self.requests[self.next]
            self.next += 1
            rec = self._record(spec)
            rec.status, rec.error = "not_sent", "the run ended before this request was sent"
            self.on_record(rec)
        self._kill_inflight()
        self._finish()

    def join(self, timeout: float | None = None) -> None:
        if self._loop is not None:
            self._loop.join(timeout)

    # -- the loop --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for i, spec in enumerate(self.requests):
                body = request_body(spec, self.builder, self.model)  # prepared before its time comes
                self._wait_until(self.t0 + spec.at)
                self.inflight[spec.index] = gevent.spawn(self._one, spec, body)
                self.next = i + 1
                gevent.sleep(0)  # let it start now, even when behind schedule
            deadline = time.perf_counter() + self.drain_timeout
            while self.inflight and time.perf_counter() < deadline:
                gevent.joinall(list(self.inflight.values()), timeout=max(0.0, deadline - time.perf_counter()))
            self._kill_inflight()
            self._finish()
        except GreenletExit:
            pass

    @staticmethod
    def _wait_until(target: float) -> None:
        """Sleep until ``target`` (perf_counter time). The event loop's timers are millisecond-grained and fire
        late by up to a millisecond, so the last SPIN_S are spent yielding in a loop (other greenlets keep
        running, and go first; it costs at most SPIN_S of CPU per request)."""
        delay = target - time.perf_counter()
        if delay > SPIN_S:
            gevent.sleep(delay - SPIN_S)
        while time.perf_counter() < target:
            gevent.idle()  # runs when the loop has nothing else to do: arriving tokens are handled first

    def _kill_inflight(self) -> None:
        if self.inflight:
            gevent.killall(list(self.inflight.values()), block=True, timeout=10)

    def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            if self._watchdog is not None and self._watchdog is not gevent.getcurrent():
                self._watchdog.kill(block=False)
            self.endpoint.close()
            self.on_finished()

    def _record(self, spec: RequestSpec) -> RequestRecord:
        return RequestRecord(
            index=spec.index, id=f"{self.run_id}-{spec.index}", worker=self.rank, kind=spec.kind,
            scheduled_at=spec.at, intended_send_time=self.t0_epoch + spec.at, prompt_tokens=spec.prompt_len,
            max_tokens=spec.output_len,
        )

    def _one(self, spec: RequestSpec, body: bytes) -> None:
        res = StreamResult(send_time=time.perf_counter())
        res.last_activity = res.send_time
        self.results[spec.index] = res
        lag = res.send_time - (self.t0 + spec.at)
        self.sent += 1
        self.lags.append(lag)
        self.max_lag = max(self.max_lag, lag)
        rec = self._record(spec)
        killed = False
        try:
            stream_completion(self.endpoint, body, res, spec.output_len, {"X-Request-Id": rec.id})
        except RequestTimeout:
            res.error = f"timeout: nothing received for {self.request_timeout:g}s"
        except GreenletExit:
            killed = True
        finally:
            self.inflight.pop(spec.index, None)
            self.results.pop(spec.index, None)
            off = self.offset
            rec.actual_send_time = res.send_time + off
            rec.token_times = [t + off for t in res.token_times]
            rec.output_tokens = len(res.token_times)
            rec.output_events = res.events
            rec.multi_token_events = res.multi_token_events
            rec.usage_tokens = int((res.usage or {}).get("completion_tokens", -1))
            rec.ttft = rec.token_times[0] - rec.intended_send_time if rec.token_times else math.nan
            rec.finish_time = res.finish_time + off if not math.isnan(res.finish_time) else math.nan
            rec.http_status = res.http_status
            if killed:
                rec.status, rec.error = "unfinished", res.error or "still streaming when the run ended"
            elif res.error or not res.done:
                rec.status, rec.error = "error", res.error or "stream ended without finishing"
            else:
                rec.status = "ok"
            self.ok += rec.status == "ok"
            self.failed += rec.status == "error"
            self.tokens += rec.output_tokens
            self.on_record(rec)

    # -- progress --------------------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """Counters for a progress line; the lag list restarts at every call."""
        lags, self.lags = self.lags, []
        lags.sort()
        now = time.perf_counter()
        due = sum(1 for _ in self._due(now))
        return {
            "scheduled": len(self.requests), "due": due, "sent": self.sent, "in_flight": len(self.inflight),
            "ok": self.ok, "failed": self.failed, "tokens": self.tokens,
            "lag_p99": lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else None,
            "lag_max": self.max_lag, "finished": self.finished,
        }

    def _due(self, now: float):
        # requests whose time has come (binary search would do; schedules are sorted)
        lo, hi = 0, len(self.requests)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.t0 + self.requests[mid].at <= now:
                lo = mid + 1
            else:
                hi = mid
        return range(lo)
