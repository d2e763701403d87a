"""Where the controller reads the engine's metrics: its ``/metrics`` directly, or the same series from a Prometheus
server that scrapes it (an instant PromQL query). Both give a :class:`Scrape` (series -> value at one time), and
everything downstream (windows, attainment, workload shape) is computed from differences of two scrapes, so the two
sources share one code path.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine import metric_names as names

# The series the controller reads (counters carry prometheus_client's `_total` suffix).
SERIES = (*(names.bucket(h) for h in (names.REQUEST_ITL_P99, names.TTFT, names.REQUEST_PROMPT_TOKENS,
                                      names.REQUEST_GENERATION_TOKENS)),
          *(names.hist_count(h) for h in (names.REQUEST_ITL_P99, names.TTFT, names.INTER_TOKEN_LATENCY)),
          *(names.hist_sum(h) for h in (names.REQUEST_PROMPT_TOKENS, names.REQUEST_GENERATION_TOKENS,
                                        names.INTER_TOKEN_LATENCY)),
          *(names.total(c) for c in (names.REQUEST_SUCCESS, names.PROMPT_TOKENS, names.GENERATION_TOKENS,
                                     names.PREFIX_QUERIES, names.PREFIX_HITS)),
          names.CONFIG_GENERATION, names.KNOB, names.LEASE_PENDING, *names.QUEUES)
# Labels that tell replicas apart in Prometheus; one source pools them (a fleet reads each replica by its own
# source: FleetSource).
_TARGET_LABELS = ("instance", "job")
# A replica's state, not a count: a fleet's scrape takes its first replica's (the canary reads each replica's own).
_STATE_SERIES = (names.KNOB, names.LEASE_PENDING)

Labels = tuple[tuple[str, str], ...]


class SourceUnavailable(RuntimeError):
    """The metrics source did not answer (or answered nonsense); the message says which and why."""


@dataclass(frozen=True)
class Scrape:
    time: float  # wall clock of the scrape
    values: dict[tuple[str, Labels], float]
    replicas: tuple[Scrape, ...] = ()  # a fleet's: each replica's own scrape (values: their sum)

    def get(self, name: str, **labels: str) -> float:
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)

    def labelled(self, name: str, label: str) -> dict[str, float]:
        """``label`` value -> value of every series of ``name`` that carries that label."""
        return {dict(k[1])[label]: v for k, v in self.values.items() if k[0] == name and label in dict(k[1])}


class MetricsSource(Protocol):
    @property
    def description(self) -> str: ...

    def scrape(self) -> Scrape: ...


def _key(name: str, labels: dict[str, str]) -> tuple[str, Labels]:
    return name, tuple(sorted((k, v) for k, v in labels.items() if k not in _TARGET_LABELS and k != "__name__"))


@dataclass
class EngineMetricsSource:
    """The engine's own ``/metrics`` (Prometheus text format)."""

    engine_url: str
    timeout: float = 10.0

    @property
    def description(self) -> str:
        return f"{self.engine_url}/metrics"

    def scrape(self) -> Scrape:
        try:
            r = httpx.get(self.engine_url.rstrip("/") + "/metrics", timeout=self.timeout)
            r.raise_for_status()
            families = list(text_string_to_metric_families(r.text))
        except (httpx.HTTPError, ValueError) as error:
            raise SourceUnavailable(f"{self.description}: {error}") from None
        values: dict[tuple[str, Labels], float] = {}
        for family in families:
            for sample in family.samples:
                if sample.name in SERIES:
                    key = _key(sample.name, sample.labels)
                    values[key] = values.get(key, 0.0) + float(sample.value)
        return Scrape(time.time(), values)


@dataclass
class PrometheusSource:
    """The same series from a Prometheus server, by one instant query; ``selector`` (e.g. ``job="engine"``) picks
    the engine's series when the server scrapes several targets."""

    prometheus_url: str
    selector: str = ""
    timeout: float = 10.0

    @property
    def description(self) -> str:
        return f"{self.prometheus_url} (PromQL)"

    def query(self) -> str:
        names = "|".join(SERIES)
        extra = f", {self.selector}" if self.selector else ""
        return f'{{__name__=~"{names}"{extra}}}'

    def scrape(self) -> Scrape:
        try:
            r = httpx.get(self.prometheus_url.rstrip("/") + "/api/v1/query", params={"query": self.query()},
                          timeout=self.timeout)
            r.raise_for_status()
            body = r.json()
        except (httpx.HTTPError, ValueError) as error:
            raise SourceUnavailable(f"{self.description}: {error}") from None
        if body.get("status") != "success":
            raise SourceUnavailable(f"{self.description}: {body.get('error') or body}")
        values: dict[tuple[str, Labels], float] = {}
        for row in body["data"]["result"]:
            labels = dict(row["metric"])
            key = _key(labels.get("__name__", ""), labels)
            values[key] = values.get(key, 0.0) + float(row["value"][1])
        if not values:
            raise SourceUnavailable(f"{self.description}: no slotune_ series (does it scrape the engine yet?)")
        return Scrape(time.time(), values)


@dataclass
class FleetSource:
    """Several replicas, each through its own source: one scrape with their sum (what the fleet served) and each
    replica's own (what the canary compares). A replica that does not answer makes the whole scrape unavailable:
    a sum without it would read as a drop in traffic."""

    sources: list[MetricsSource]

    @property
    def description(self) -> str:
        return f"{len(self.sources)} replicas: " + ", ".join(s.description for s in self.sources)

    def scrape(self) -> Scrape:
        replicas = tuple(source.scrape() for source in self.sources)
        values: dict[tuple[str, Labels], float] = {}
        for replica in replicas:
            for key, value in replica.values.items():
                if key[0] in _STATE_SERIES:
                    values.setdefault(key, value)
                else:
                    values[key] = values.get(key, 0.0) + value
        return Scrape(max(r.time for r in replicas), values, replicas)


def discover(url: str) -> list[str]:
    """One URL per address the URL's host name resolves to (the replicas of a service behind one DNS name, as
    Docker's and Kubernetes' headless services give them), in a stable order."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname or "", port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise SourceUnavailable(f"cannot resolve the replicas of {url}: {error}") from None
    hosts = sorted({str(info[4][0]) for info in infos})
    return [f"{parts.scheme}://{f'[{h}]' if ':' in h else h}:{port}" for h in hosts]


def fleet_source(urls: list[str], prometheus_url: str | None = None, selector: str = "") -> MetricsSource:
    """The metrics of one engine or of a fleet: each replica's /metrics, or its series in Prometheus (picked by its
    ``instance`` label, the address Prometheus scrapes it at)."""
    def one(url: str) -> MetricsSource:
        if prometheus_url is None:
            return EngineMetricsSource(url)
        if len(urls) == 1:
            return PrometheusSource(prometheus_url, selector)
        instance = f'instance="{urlsplit(url).netloc}"'
        return PrometheusSource(prometheus_url, f"{selector}, {instance}" if selector else instance)

    return one(urls[0]) if len(urls) == 1 else FleetSource([one(u) for u in urls])
