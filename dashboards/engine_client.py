"""The Live page's view of a running engine, over HTTP only (GET /debug/steps?since=N, /metrics, /admin/config).

`LiveFeed` keeps the most recent step records in this process, fetching only the steps after the last one it
has, so each poll moves a few KB, not the whole history."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine import metric_names as names
from engine.knobs import KNOB_BY_NAME
from tuner.trials.engine_metrics import SLOTUNE_SERIES, gauges_by_label, histogram_buckets  # the one reader

ITL_METRIC = SLOTUNE_SERIES.inter_token_latency
TIMEOUT_S = 3.0
DEFAULT_KEEP_STEPS = 1000
LATEST = 2**62  # since=LATEST: no records, only the engine's last step number


class EngineUnreachable(RuntimeError):
    """The engine did not answer (or answered with an error): the Live page's empty state."""


@dataclass(frozen=True)
class HistogramBuckets:
    """A Prometheus histogram as upper bounds and cumulative counts (le=+Inf last)."""

    upper: list[float]
    cumulative: list[float]

    @property
    def counts(self) -> list[float]:
        return [c - (self.cumulative[i - 1] if i else 0.0) for i, c in enumerate(self.cumulative)]

    @property
    def total(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear interpolation inside the bucket holding the q-th observation."""
        if not self.cumulative or self.total <= 0:
            return None
        rank = q * self.total
        for i, c in enumerate(self.cumulative):
            if c >= rank:
                if self.upper[i] == float("inf"):
                    return self.upper[i - 1] if i else None
                lo = self.upper[i - 1] if i else 0.0
                below = self.cumulative[i - 1] if i else 0.0
                inside = c - below
                return lo + (self.upper[i] - lo) * ((rank - below) / inside if inside else 1.0)
        return None


def parse_histogram(metrics_text: str, name: str, labels: dict[str, str] | None = None) -> HistogramBuckets:
    """The buckets of histogram `name` (with these labels) in a Prometheus exposition; empty if absent."""
    buckets = histogram_buckets(metrics_text, name, labels)
    return HistogramBuckets(list(buckets), list(buckets.values()))


@dataclass
class EngineClient:
    url: str
    admin_token: str | None = None
    timeout: float = TIMEOUT_S

    def _get(self, path: str, auth: bool = False) -> bytes:
        request = urllib.request.Request(self.url.rstrip("/") + path)
        if auth and self.admin_token:
            request.add_header("Authorization", f"Bearer {self.admin_token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as error:
            raise EngineUnreachable(f"{self.url}{path} answered {error.code}: "
                                    f"{error.read().decode('utf-8', 'replace')[:200]}") from None
        except (urllib.error.URLError, OSError, TimeoutError) as error:
            reason = getattr(error, "reason", error)
            raise EngineUnreachable(f"the engine at {self.url} is unreachable ({reason})") from None

    def steps(self, since: int = -1) -> tuple[list[dict[str, Any]], int]:
        """Step records after step `since`, and the engine's last step index."""
        data = json.loads(self._get(f"/debug/steps?since={since}"))
        return list(data.get("steps") or []), int(data.get("last_step", -1))

    def metrics_text(self) -> str:
        return self._get("/metrics").decode("utf-8", "replace")

    def config(self) -> dict[str, Any] | None:
        """GET /admin/config ({"config", "generation", "resolved"}); None without an admin token."""
        if not self.admin_token:
            return None
        return dict(json.loads(self._get("/admin/config", auth=True)))


@dataclass
class LiveSnapshot:
    steps: list[dict[str, Any]]
    itl: HistogramBuckets
    knobs: dict[str, Any]
    generation: int | None
    knobs_source: str  # "admin": GET /admin/config; "metrics": the slotune_knob gauges (numbers only)
    config_error: str | None  # why /admin/config could not be read (then the gauges are shown)
    total_steps_seen: int


@dataclass
class LiveFeed:
    """The recent step records of one engine, refreshed by `poll()` (thread-safe: Dash serves callbacks in
    threads)."""

    client: EngineClient
    keep: int = DEFAULT_KEEP_STEPS
    _steps: deque[dict[str, Any]] = field(default_factory=deque)
    _last: int = -1
    _seen: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _catch_up(self) -> tuple[list[dict[str, Any]], int]:
        """The last `keep` steps only (the engine's buffer may hold thousands): ask where it is, then from there."""
        _, last = self.client.steps(LATEST)
        return self.client.steps(max(-1, last - self.keep))

    def poll(self) -> LiveSnapshot:
        with self._lock:
            new, last = self.client.steps(self._last) if self._last >= 0 else self._catch_up()
            if last < self._last:  # the engine restarted: its step numbers began again
                self._steps.clear()
                self._last = -1
                new, last = self._catch_up()
            self._steps.extend(new)
            while len(self._steps) > self.keep:
                self._steps.popleft()
            if new:
                self._last = int(new[-1]["step"])
                self._seen += len(new)
            steps = list(self._steps)
            seen = self._seen
        text = self.client.metrics_text()
        itl = parse_histogram(text, ITL_METRIC)
        config, config_error = None, None
        try:
            config = self.client.config()
        except EngineUnreachable as error:
            config_error = str(error)
        if config is not None:
            knobs, generation, source = dict(config.get("config") or {}), config.get("generation"), "admin"
        else:
            gauges = gauges_by_label(text, names.CONFIG_GENERATION, "")
            knobs = {k: KNOB_BY_NAME[k].from_number(v) if k in KNOB_BY_NAME else v
                     for k, v in gauges_by_label(text, names.KNOB, "name").items()}
            generation = int(gauges[""]) if "" in gauges else None
            source = "metrics"
        return LiveSnapshot(steps=steps, itl=itl, knobs=knobs, generation=generation, knobs_source=source,
                            config_error=config_error, total_steps_seen=seen)
