"""The admin API's lease (a config the engine reverts by itself unless confirmed in time), the prefix-cache reset
that lets measurements start from the same state, and the per-request p99 inter-token histogram, on a real engine
behind a real HTTP server."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from server_helpers import InProcessServer, metric, scrape

TOKEN = "lease-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server() -> InProcessServer:
    s = InProcessServer(admin_token=TOKEN, max_num_seqs=8, block_size=16)
    yield s
    s.stop()


def call(server: InProcessServer, method: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(method, server.url + path, json=body, headers=AUTH, timeout=60)


def config(server: InProcessServer) -> dict[str, Any]:
    r = call(server, "GET", "/admin/config")
    assert r.status_code == 200, r.text
    return r.json()


def complete(server: InProcessServer, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_an_unconfirmed_lease_reverts_to_the_last_kept_config(server: InProcessServer) -> None:
    start = config(server)
    kept_seqs = start["config"]["max_num_seqs"]
    r = call(server, "PATCH", "/admin/config", {"max_num_seqs": 3, "lease_s": 0.6})
    assert r.status_code == 200, r.text
    leased = r.json()
    assert leased["config"]["max_num_seqs"] == 3 and leased["lease"]["generation"] == leased["generation"]
    assert leased["lease"]["kept_generation"] == start["generation"]
    # A second leased move before the first is confirmed still returns to the last *kept* config.
    r = call(server, "PATCH", "/admin/config", {"block_size": 32, "lease_s": 0.6})
    assert r.status_code == 200 and r.json()["lease"]["kept_generation"] == start["generation"]
    reverts_before = metric(scrape(server.url), "slotune_config_lease_reverts_total")
    assert wait_for(lambda: config(server)["lease"] is None, 5.0), "the lease did not expire"
    after = config(server)
    assert after["config"]["max_num_seqs"] == kept_seqs and after["config"]["block_size"] == 16
    assert after["generation"] > r.json()["generation"]  # the revert is a new generation
    assert metric(scrape(server.url), "slotune_config_lease_reverts_total") == reverts_before + 1
    # The engine kept serving through the re-layouts and the revert.
    out = complete(server, list(range(1, 40)), 8)
    assert out["usage"]["completion_tokens"] == 8


def test_a_confirmed_lease_is_kept_and_a_stale_confirmation_is_refused(server: InProcessServer) -> None:
    r = call(server, "PATCH", "/admin/config", {"max_num_seqs": 5, "lease_s": 30})
    generation = r.json()["generation"]
    stale = call(server, "POST", "/admin/config/confirm", {"generation": generation - 1})
    assert stale.status_code == 409 and "not under lease" in stale.json()["error"]["message"]
    ok = call(server, "POST", "/admin/config/confirm", {"generation": generation})
    assert ok.status_code == 200 and ok.json()["lease"] is None and ok.json()["generation"] == generation
    again = call(server, "POST", "/admin/config/confirm", {"generation": generation})
    assert again.status_code == 409  # nothing is under lease any more
    time.sleep(0.3)
    assert config(server)["config"]["max_num_seqs"] == 5
    for bad in ({"max_num_seqs": 4, "lease_s": 0}, {"max_num_seqs": 4, "lease_s": "10"},
                {"max_num_seqs": 4, "lease_s": True}):
        r = call(server, "PATCH", "/admin/config", bad)
        assert r.status_code == 422 and r.json()["error"]["param"] == "lease_s", r.text
    assert config(server)["config"]["max_num_seqs"] == 5  # a refused PATCH changed nothing
    assert call(server, "POST", "/admin/config/confirm", {"gen": 1}).status_code == 422


def test_reset_prefix_cache_makes_a_repeat_compute_its_prompt_again(server: InProcessServer) -> None:
    call(server, "PATCH", "/admin/config", {"enable_prefix_caching": True})
    prompt = [7 + (i % 50) for i in range(96)]  # six full 16-token blocks
    complete(server, prompt, 4)
    hits_before = metric(scrape(server.url), "slotune_prefix_cache_hits_total")
    complete(server, prompt, 4)
    hits_cached = metric(scrape(server.url), "slotune_prefix_cache_hits_total")
    assert hits_cached - hits_before >= 80  # the repeat rode on the first request's blocks
    r = call(server, "POST", "/admin/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["dropped_blocks"] >= 5
    complete(server, prompt, 4)
    assert metric(scrape(server.url), "slotune_prefix_cache_hits_total") == hits_cached  # nothing left to hit
    assert httpx.post(server.url + "/admin/reset_prefix_cache").status_code == 401
    assert server.engine.scheduler.kv.num_used_blocks == 0  # no block leaked


def test_each_finished_request_adds_its_own_p99_gap_to_a_histogram(server: InProcessServer) -> None:
    before = metric(scrape(server.url), "slotune_request_itl_p99_seconds_count")
    for _ in range(3):
        complete(server, [1, 2, 3, 4], 12)
    samples = scrape(server.url)
    assert metric(samples, "slotune_request_itl_p99_seconds_count") == before + 3
    # Every request's own p99 gap is at most its largest gap, which the ITL histogram's count bounds from above.
    assert metric(samples, "slotune_request_itl_p99_seconds_sum") > 0
