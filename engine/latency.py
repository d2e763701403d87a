"""Request latencies as the server's histograms define them (engine/metrics.py), measured in the engine thread
where tokens are produced: queue time, time to first token, every inter-token gap, each finished request's own
p99 gap, end-to-end latency, and its prompt and output lengths. Times are `time.monotonic()`.

A request counts in the per-request histograms (e2e, its own p99 gap, its lengths) when it finished on stop or length:
an aborted request's output was cut short by its client, not by the workload, so it would bias the lengths."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.metrics import ServerMetrics


@dataclass(slots=True)
class _Timing:
    arrival: float  # when the HTTP request arrived
    queued: bool = True  # not yet scheduled for the first time
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)  # inter-token gaps, for the request's own p99


class LatencyTracker:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._timings: dict[str, _Timing] = {}

    def arrived(self, request_id: str, arrival: float) -> None:
        self._timings[request_id] = _Timing(arrival)

    def forget(self, request_id: str) -> None:
        """Stop tracking a request that ended without finishing (aborted or failed)."""
        self._timings.pop(request_id, None)

    def scheduled(self, request_ids: Iterable[str], step_start: float) -> None:
        """The requests in the running set after the step that began at `step_start`."""
        for request_id in request_ids:
            timing = self._timings.get(request_id)
            if timing is not None and timing.queued:
                self._leave_queue(timing, step_start)

    def tokens(self, request_id: str, num_new: int, now: float, step_start: float) -> None:
        """`num_new` tokens of the request came out of the step that ended at `now`."""
        timing = self._timings.get(request_id)
        if timing is None or not num_new:
            return
        if timing.queued:
            self._leave_queue(timing, step_start)
        if timing.last_token is None:
            self.metrics.ttft.observe(now - timing.arrival)
            num_gaps, gap = num_new - 1, 0.0
        else:
            num_gaps, gap = num_new, now - timing.last_token
        for _ in range(num_gaps):
            self.metrics.itl.observe(gap)
            timing.gaps.append(gap)
        timing.last_token = now

    def finished(self, request_id: str, finish_reason: str | None, now: float, num_prompt_tokens: int,
                 num_output_tokens: int) -> None:
        timing = self._timings.pop(request_id, None)
        if timing is not None and finish_reason in ("stop", "length"):
            self.metrics.e2e.observe(now - timing.arrival)
            self.metrics.observe_request_itl_p99(timing.gaps)
            self.metrics.observe_request_lengths(num_prompt_tokens, num_output_tokens)

    def _leave_queue(self, timing: _Timing, step_start: float) -> None:
        timing.queued = False
        self.metrics.queue_time.observe(max(0.0, step_start - timing.arrival))
