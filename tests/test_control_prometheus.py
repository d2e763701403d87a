"""One code path, two sources: the same series read from the engine's /metrics and through a real Prometheus server
that scrapes it give the same scrape, hence the same windows (attainment, tokens, the length histograms' buckets);
and an unreachable Prometheus is reported."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import SubprocessServer, free_port

from slotune.slo import SLO
from tuner.control.sources import EngineMetricsSource, PrometheusSource, Scrape, SourceUnavailable
from tuner.control.window import window

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed")


@pytest.fixture(scope="module")
def engine() -> Iterator[SubprocessServer]:
    server = SubprocessServer(args=["--max-num-seqs", "4"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prometheus(engine: SubprocessServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("prometheus")
    target = engine.url.removeprefix("http://")
    (root / "prometheus.yml").write_text(f"global: {{scrape_interval: 1s}}\nscrape_configs:\n  - job_name: engine\n"
                                         f"    static_configs: [{{targets: ['{target}']}}]\n")
    port = free_port()
    assert PROMETHEUS is not None
    with open(root / "prometheus.log", "wb") as log:
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={root / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (root / "prometheus.log").read_text()[-2000:]
        time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(30)


def complete(engine: SubprocessServer, n: int) -> None:
    for i in range(n):
        r = httpx.post(engine.url + "/v1/completions", timeout=120, json={
            "model": engine.model, "prompt": [100 + i + j for j in range(12)], "max_tokens": 6, "ignore_eos": True,
            "temperature": 0})
        assert r.status_code == 200, r.text


def settled(engine_source: EngineMetricsSource, prom: PrometheusSource, timeout: float = 30) -> tuple[Scrape, Scrape]:
    """A pair of scrapes once Prometheus has caught up with the idle engine."""
    deadline = time.monotonic() + timeout
    while True:
        direct = engine_source.scrape()
        try:
            via = prom.scrape()
        except SourceUnavailable:
            via = None
        if via is not None and via.values == direct.values:
            return direct, via
        assert time.monotonic() < deadline, "Prometheus never matched the engine's own series"
        time.sleep(0.5)


def test_both_sources_give_the_same_series_and_windows(engine: SubprocessServer, prometheus: str) -> None:
    direct_source, prom_source = EngineMetricsSource(engine.url), PrometheusSource(prometheus, 'job="engine"')
    before = settled(direct_source, prom_source)
    complete(engine, 5)
    after = settled(direct_source, prom_source)
    slo = SLO(tbt_p99=5.0)
    w_direct, w_prom = window(before[0], after[0], slo), window(before[1], after[1], slo)
    assert w_direct.finished == w_prom.finished == 5 and w_direct.attaining == w_prom.attaining == 5
    assert w_direct.prompt_tokens == w_prom.prompt_tokens == 60
    # the per-request length histograms, bucket by bucket (12-token prompts, 6 tokens out)
    assert w_direct.prompt_lengths == w_prom.prompt_lengths and w_direct.output_lengths == w_prom.output_lengths
    assert (w_prom.prompt_lengths.n, w_prom.prompt_lengths.total) == (5, 60)
    assert (w_prom.output_lengths.n, w_prom.output_lengths.total) == (5, 30)
    assert w_prom.prompt_lengths.as_dict()["buckets"] == {"20": 5} and w_prom.output_lengths.as_dict()["buckets"] == \
        {"10": 5}
    # how long a request runs (a switchback block settles for that long): its outputs times the mean gap
    assert w_prom.mean_gap == w_direct.mean_gap and 0 < w_prom.mean_gap < 5.0
    assert w_prom.service_s == pytest.approx(6 * w_prom.mean_gap)


def test_an_unreachable_prometheus_is_reported(tmp_path: Path) -> None:
    with pytest.raises(SourceUnavailable, match="PromQL"):
        PrometheusSource(f"http://127.0.0.1:{free_port()}").scrape()
