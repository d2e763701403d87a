"""A real `slotune serve` process: the admin API, a live PATCH of every knob under load, 500 requests with a
third of them disconnected, the step log, and SIGTERM. One server for the module; SIGTERM ends it last."""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import SubprocessServer, delta, metric, scrape, stream_completion

TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
WORDS = ("apple river stone cloud music garden engine paper window silver forest candle bridge winter "
         "ocean letter mirror planet copper island").split()


@pytest.fixture(scope="module")
def server() -> SubprocessServer:
    folder = Path(tempfile.mkdtemp(prefix="slotune-live-"))
    step_log = folder / "steps.jsonl"
    tuned = folder / "tuned.yaml"  # as `tune` writes it; the flags override it
    tuned.write_text("slo:\n  tbt_p99_ms: 50\nknobs:\n  max_num_seqs: 16\n  chunk_size: 512\n")
    # float32: greedy outputs are then exactly unchanged by live changes of the batch (bf16 rounding depends on
    # the row count of each matrix product)
    s = SubprocessServer(args=["--config", str(tuned), "--max-num-seqs", "64", "--step-log", str(step_log),
                               "--shutdown-timeout", "60", "--dtype", "float32"],
                         env={"SLOTUNE_ADMIN_TOKEN": TOKEN})  # the token from the environment
    s.step_log = step_log
    yield s
    s.stop()


def admin(server: SubprocessServer, method: str, body: Any = None, headers: dict[str, str] | None = None
          ) -> httpx.Response:
    return httpx.request(method, server.url + "/admin/config", json=body,
                         headers=AUTH if headers is None else headers, timeout=60)


def test_admin_auth_and_validation(server: SubprocessServer) -> None:
    assert admin(server, "GET", headers={}).status_code == 401
    assert admin(server, "GET", headers={"authorization": "Bearer wrong"}).status_code == 401
    assert admin(server, "PATCH", {"max_num_seqs": 8}, headers={}).status_code == 401
    current = admin(server, "GET").json()
    generation = current["generation"]
    assert current["config"]["block_size"] == 16
    assert current["config"]["chunk_size"] == 512 and current["config"]["max_num_seqs"] == 64  # file, then flag
    for body, knob in (({"block_size": 0}, "block_size"), ({"no_such_knob": 1}, "no_such_knob"),
                       ({"max_num_seqs": 10, "max_num_batched_tokens": 5}, "max_num_seqs"),
                       ({"max_num_seqs": 32, "preemption_mode": "teleport"}, "preemption_mode"),
                       ({"num_kv_blocks": 10**9}, "num_kv_blocks"), ({"chunk_size": "64"}, "chunk_size")):
        response = admin(server, "PATCH", body)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["knob"] == knob and knob in error["message"]
    assert admin(server, "PATCH", [1, 2]).status_code == 422
    bad_json = httpx.patch(server.url + "/admin/config", content=b"{", headers=AUTH)
    assert bad_json.status_code == 400
    after = admin(server, "GET").json()
    assert after == current and after["generation"] == generation  # all-or-nothing: nothing changed


def _prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 10))) for _ in range(n)]


def test_live_patch_of_every_knob_under_load(server: SubprocessServer) -> None:
    prompts = _prompts(32, seed=1)
    max_tokens = 16
    original = admin(server, "GET").json()
    g0 = original["generation"]
    first_step = httpx.get(server.url + "/health").json()["last_step"]
    before = scrape(server.url)
    patches = [
        # every knob, the KV pool sized in bytes
        {"max_num_seqs": 24, "max_num_batched_tokens": 256, "chunk_size": 32, "prefill_token_ratio": 0.5,
         "block_size": 32, "kv_cache_bytes": 64 << 20, "num_kv_blocks": None, "max_model_len": 1024,
         "preemption_mode": "swap", "swap_space_bytes": 32 << 20, "enable_prefix_caching": False,
         "scheduling_policy": "priority"},
        # a small pool in blocks, so that running sequences are preempted (and swapped)
        {"max_num_seqs": 32, "max_num_batched_tokens": 128, "chunk_size": 16, "prefill_token_ratio": 0.25,
         "block_size": 8, "num_kv_blocks": 16, "max_model_len": 128, "preemption_mode": "swap",
         "enable_prefix_caching": True, "scheduling_policy": "fcfs"},
    ]

    async def run() -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:
            body = {"model": server.model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            baseline = await asyncio.gather(*(http.post("/v1/completions", json={**body, "prompt": p})
                                              for p in prompts))
            texts = [r.json()["choices"][0]["text"] for r in baseline]
            progress = [0]
            jobs = [asyncio.ensure_future(stream_completion(http, {**body, "prompt": p}, progress=progress))
                    for p in prompts]
            responses = []
            # PATCH at about 1 and 6 tokens per request, while all 32 are in flight.
            for patch, threshold in zip(patches, (len(prompts), 6 * len(prompts))):
                while progress[0] < threshold:
                    await asyncio.sleep(0.01)
                response = await http.patch("/admin/config", json=patch, headers=AUTH)
                assert response.status_code == 200, response.text
                responses.append(response.json())
                assert not all(j.done() for j in jobs), "the requests finished before the PATCH"
            return texts, list(await asyncio.gather(*jobs)), responses

    baseline, streamed, responses = asyncio.run(run())
    assert [r["generation"] for r in responses] == [g0 + 1, g0 + 2]
    assert responses[1]["config"]["block_size"] == 8 and responses[1]["config"]["num_kv_blocks"] == 16
    for result, expected in zip(streamed, baseline):
        assert result["done"] and result["finish_reason"] == "length"
        assert len(result["texts"]) == max_tokens
        assert "".join(result["texts"]) == expected  # greedy outputs unchanged by the live changes
    current = admin(server, "GET").json()
    assert current["generation"] == g0 + 2 and current["config"] == responses[1]["config"]
    after = scrape(server.url)
    assert metric(after, "slotune_config_generation") == g0 + 2
    assert metric(after, "slotune_knob", name="block_size") == 8
    assert metric(after, "slotune_knob", name="num_kv_blocks") == 16
    assert delta(before, after, "slotune_config_updates_total") == 2
    steps = httpx.get(server.url + "/debug/steps", params={"since": first_step}).json()["steps"]
    generations = {s["config_generation"] for s in steps}
    assert {g0 + 1, g0 + 2} <= generations
    # The small pool really preempted running sequences, and swap mode moved their blocks to the host.
    assert delta(before, after, "slotune_preemptions_total") > 0
    assert any(s["num_swapped_blocks"] for s in steps if s["config_generation"] == g0 + 2)
    assert metric(after, "slotune_kv_cache_usage_ratio") == 0 and metric(after, "slotune_num_requests_running") == 0
    # Back to the original knobs.
    restored = admin(server, "PATCH", original["config"])
    assert restored.status_code == 200 and restored.json()["config"] == original["config"]
    assert restored.json()["generation"] == g0 + 3


def test_500_requests_with_a_third_disconnected(server: SubprocessServer) -> None:
    rng = random.Random(7)
    prompts = _prompts(500, seed=2)
    plans = []
    for i, prompt in enumerate(prompts):
        n = rng.randint(1, 8)
        leave: tuple[str, float] | None = None
        if i % 3 == 0:
            leave = ("timeout", rng.uniform(0.0, 3.0)) if rng.random() < 0.4 else ("after", rng.randint(0, n - 1))
        plans.append((prompt, n, leave))

    async def one(http: httpx.AsyncClient, prompt: str, n: int, leave: tuple[str, float] | None
                  ) -> dict[str, Any] | None:
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        if leave is None:
            return await stream_completion(http, body)
        if leave[0] == "after":
            await stream_completion(http, body, stop_after=int(leave[1]))
            return None
        try:
            await asyncio.wait_for(stream_completion(http, body), timeout=leave[1])
        except asyncio.TimeoutError:
            pass
        return None

    async def run() -> list[dict[str, Any] | None]:
        limits = httpx.Limits(max_connections=600, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:
            return await asyncio.gather(*(one(http, *plan) for plan in plans))

    results = asyncio.run(run())
    for (_prompt, n, leave), result in zip(plans, results):
        if leave is None:
            assert result is not None and result["status"] == 200, result
            assert result["done"] and len(result["texts"]) == n
    deadline = time.monotonic() + 60
    while True:
        samples = scrape(server.url)
        state = {k: metric(samples, k) for k in ("slotune_num_requests_running", "slotune_num_requests_waiting",
                                                 "slotune_num_requests_preempted", "slotune_kv_cache_usage_ratio")}
        if not any(state.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(state.values()), state
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["kv_cache_usage"] == 0


def test_step_log_matches_debug_steps(server: SubprocessServer) -> None:
    # steps of its own (a prefill and 7 decodes at least), so that the test does not rely on the module's others
    body = {"prompt": "Count to ten:", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    logged = [json.loads(line) for line in server.step_log.read_text().splitlines()]
    assert len(logged) >= 8
    served = httpx.get(server.url + "/debug/steps", params={"since": logged[-1]["step"] - 5}).json()["steps"]
    assert served == logged[-len(served):]
    assert [r["step"] for r in logged] == list(range(logged[0]["step"], logged[-1]["step"] + 1))


def test_sigterm_finishes_in_flight_requests_and_exits_cleanly(server: SubprocessServer) -> None:
    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            body = {"prompt": "Count to ten:", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
            jobs = [asyncio.ensure_future(stream_completion(http, {**body, "prompt": p})) for p in _prompts(4, 3)]
            while httpx.get(server.url + "/health").json()["num_running"] < 4:
                await asyncio.sleep(0.05)
            server.terminate()
            await asyncio.sleep(1.0)
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                httpx.get(server.url + "/health", timeout=5)
            return list(await asyncio.gather(*jobs))

    results = asyncio.run(run())
    for result in results:
        assert result["done"] and len(result["texts"]) == 20, result
    assert server.process.wait(60) == 0, server.output()
