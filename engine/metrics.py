"""The server's Prometheus metrics (names and buckets: docs/architecture.md, "Metrics").

Latency and request-length histograms are observed by the engine thread where tokens are produced and requests finish
(`engine.latency`); gauges and the counters that mirror the engine's own totals (tokens, preemptions, prefix cache,
finished requests) are read from the latest `EngineSnapshot` at scrape time, so they agree exactly with the engine
and never double count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from engine import metric_names as names
from engine.knobs import KNOB_BY_NAME, KNOBS
from engine.snapshot import EngineSnapshot
from engine.step_record import StepRecord

# the knob gauges' help: a name knob's value is the index of its choice, listed from the knob schema itself
KNOB_GAUGE_HELP = ("Applied knob values ('auto' resolved; booleans 0/1; " + "; ".join(
    f"{k.name}: " + ", ".join(f"{i} {c}" for i, c in enumerate(k.choices)) for k in KNOBS if k.choices) + ").")

__all__ = ["CONTENT_TYPE_LATEST", "LATENCY_BUCKETS", "LENGTH_BUCKETS", "TOKEN_BUCKETS", "ServerMetrics",
           "knob_values"]

# Fine below 100 ms, so a 50 ms SLO can be read from histogram_quantile.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1,
                   0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A finished request's prompt and output lengths (as vLLM's request_prompt_tokens / request_generation_tokens): 1-2-5
# steps per decade, so the controller can compare the length distributions of two windows bucket by bucket.
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


def knob_values(snapshot: EngineSnapshot) -> dict[str, float]:
    """Every knob as a number, with 'auto' values resolved (what the engine actually uses)."""
    config, limits = snapshot.config, snapshot.limits
    values: dict[str, float] = {}
    for name, value in config.knobs().items():
        if value is not None:  # a name knob as the index of its choice (engine.knobs)
            values[name] = KNOB_BY_NAME[name].as_number(value)
    values["chunk_size"] = float(config.max_chunk())
    values["num_kv_blocks"] = float(config.resolved_num_kv_blocks(limits))
    values["max_model_len"] = float(config.resolved_max_model_len(limits))
    return values


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge(names.RUNNING, "Requests in the running set.", s.num_running)
        yield gauge(names.WAITING, "Requests waiting for their first admission.", s.num_waiting)
        yield gauge(names.PREEMPTED, "Requests preempted and waiting to resume.", s.num_preempted)
        yield gauge(names.KV_CACHE_USAGE, "Share of KV blocks in use (0..1).", s.kv_cache_usage)
        yield gauge(names.KV_BLOCKS_USED, "KV blocks in use.", s.kv_blocks_used)
        yield gauge(names.KV_BLOCKS_FREE, "KV blocks free (including evictable cached ones).",
                    s.kv_blocks_free)
        yield counter(names.PREEMPTIONS, "Preemptions since start.", s.preemptions)
        yield counter(names.PROMPT_TOKENS, "Prompt tokens of requests that produced a first token.",
                      s.prompt_tokens)
        yield counter(names.GENERATION_TOKENS, "Generated tokens.", s.generation_tokens)
        yield counter(names.PREFIX_QUERIES, "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter(names.PREFIX_HITS, "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        finished = CounterMetricFamily(names.REQUEST_SUCCESS, "Finished requests by reason (stop, length, "
                                       "abort).", labels=["finished_reason"])
        for reason in sorted(set(s.requests_finished) | {"stop", "length", "abort"}):
            finished.add_metric([reason], s.requests_finished.get(reason, 0))
        yield finished
        yield gauge(names.CONFIG_GENERATION, "Generation number of the applied engine config.",
                    s.config.generation)
        knobs = GaugeMetricFamily(names.KNOB, KNOB_GAUGE_HELP, labels=["name"])
        for name, value in knob_values(s).items():
            knobs.add_metric([name], value)
        yield knobs
        yield counter(names.LEASE_REVERTS, "Leased configs the engine reverted by itself (not "
                      "confirmed in time).", s.lease_reverts)
        yield gauge(names.LEASE_PENDING, "1 while an applied config waits for its confirmation.",
                    1.0 if s.lease is not None else 0.0)
        yield gauge(names.MAX_MODEL_LEN, "Longest prompt + output a request may have.", s.max_model_len)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()  # no `_created` series (as vLLM): they double the scrape for nothing
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        r = self.registry

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = latency(names.TTFT,
                            "Arrival of the HTTP request to its first generated token.")
        self.itl = latency(names.INTER_TOKEN_LATENCY,
                           "Gap between two consecutive generated tokens of one request.")
        self.e2e = latency(names.E2E,
                           "Arrival to the last token, for requests finished on stop or length.")
        self.request_itl_p99 = latency(names.REQUEST_ITL_P99,
                                       "The 99th percentile of one finished request's own inter-token gaps (0 "
                                       "with fewer than two tokens): the share at or below a TBT target is the "
                                       "requests' TBT attainment.")
        self.request_prompt_tokens = Histogram(names.REQUEST_PROMPT_TOKENS, "Prompt tokens of one finished "
                                               "request (stop or length).", buckets=LENGTH_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(names.REQUEST_GENERATION_TOKENS, "Generated tokens of one "
                                                   "finished request (stop or length).", buckets=LENGTH_BUCKETS,
                                                   registry=r)
        self.queue_time = latency(names.QUEUE_TIME,
                                  "Arrival to the start of the step that first scheduled the request.")
        self.step_duration = latency(names.STEP_DURATION, "Wall time of one engine step.")
        self.step_tokens = Histogram(names.STEP_TOKENS, "Tokens one step computed, by phase (a step without "
                                     "tokens of a phase is not counted for it).", ["phase"],
                                     buckets=TOKEN_BUCKETS, registry=r)
        self._prefill_tokens = self.step_tokens.labels(phase="prefill")
        self._decode_tokens = self.step_tokens.labels(phase="decode")
        self.config_changes = Counter(names.CONFIG_UPDATES, "Live config updates applied.", registry=r)
        self.http_responses = Counter(names.HTTP_RESPONSES, "HTTP responses by path and status code.",
                                      ["path", "code"], registry=r)

    def export_snapshots(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        """Export the gauges and engine totals of `snapshot()` (the latest one) at every scrape."""
        self.registry.register(_SnapshotCollector(snapshot))

    def observe_step(self, record: StepRecord) -> None:
        self.step_duration.observe(record.total_s)
        if record.num_prefill_tokens:
            self._prefill_tokens.observe(record.num_prefill_tokens)
        if record.num_decode_tokens:
            self._decode_tokens.observe(record.num_decode_tokens)

    def observe_request_itl_p99(self, gaps: list[float]) -> None:
        # the same percentile as the load generator's per-request p99 (numpy's linear interpolation)
        self.request_itl_p99.observe(float(np.percentile(gaps, 99)) if gaps else 0.0)

    def observe_request_lengths(self, prompt_tokens: int, generation_tokens: int) -> None:
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)

    def config_changed(self) -> None:
        self.config_changes.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
