"""What the server admits and how it refuses, on a real engine behind a real HTTP server: the waiting bound counts
requests beyond the free running slots (a burst fills the slots first; a 429 says when to retry), a request that
could never fit is a 400, a refused knob's value is valid JSON, and at the shutdown deadline every request still
running ends with a final "abort" event instead of being cut. One server for the module; shutdown ends it last."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from typing import Any

import httpx
import pytest
from server_helpers import InProcessServer, stream_completion

TOKEN = "admission-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SLOTS, BOUND = 16, 8


@pytest.fixture(scope="module")
def server() -> InProcessServer:
    s = InProcessServer(admin_token=TOKEN, max_waiting_requests=BOUND, shutdown_timeout=2, max_num_seqs=SLOTS)
    yield s
    s.stop()


def strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def wait_running(server: InProcessServer, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(server.url + "/health").json()["num_running"] < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests running after {timeout} s"
        time.sleep(0.02)


def test_a_burst_fills_the_free_slots_before_the_bound_refuses(server: InProcessServer,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real_step = server.engine.step
    slow_until = [math.inf]

    def slow_step() -> Any:
        if time.monotonic() < slow_until[0]:
            time.sleep(1.0)  # the burst arrives while the engine is inside one step (sleep releases the GIL)
        return real_step()

    body = {"prompt": "Tell me a story.", "max_tokens": 8, "ignore_eos": True, "temperature": 0}

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            holder = asyncio.ensure_future(stream_completion(http, {**body, "max_tokens": 40}))
            while server.engine.scheduler.num_running < 1:
                await asyncio.sleep(0.01)
            # slow steps for the burst's first seconds only: it is admitted or refused by then, and the admitted
            # requests then run at the engine's speed
            slow_until[0] = time.monotonic() + 3.0
            monkeypatch.setattr(server.engine, "step", slow_step)
            burst = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(60)))
            monkeypatch.setattr(server.engine, "step", real_step)
            await holder
            return list(burst)

    burst = asyncio.run(run())
    admitted = [r for r in burst if r.status_code == 200]
    refused = [r for r in burst if r.status_code == 429]
    # One slot is held: the other 15 take requests at once, and BOUND more may wait beyond them.
    assert len(admitted) == SLOTS - 1 + BOUND and len(refused) == len(burst) - len(admitted), \
        sorted(r.status_code for r in burst)
    for response in refused:
        assert int(response.headers["retry-after"]) >= 1
        assert "retry later" in response.json()["error"]["message"]
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in admitted)


def test_more_prompts_than_can_ever_be_taken_is_a_400(server: InProcessServer) -> None:
    too_many = httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"prompt": ["hi"] * 200, "max_tokens": 1})
    assert too_many.status_code == 400, too_many.text
    message = too_many.json()["error"]["message"]
    assert "200 prompts" in message and str(SLOTS + BOUND) in message
    assert too_many.json()["error"]["param"] == "prompt"
    fits = httpx.post(server.url + "/v1/completions", timeout=120,
                      json={"prompt": ["hi"] * (SLOTS + BOUND), "max_tokens": 1})
    assert fits.status_code == 200 and len(fits.json()["choices"]) == SLOTS + BOUND


def test_a_refused_knob_value_is_answered_in_valid_json(server: InProcessServer) -> None:
    before = httpx.get(server.url + "/admin/config", headers=AUTH).json()
    for raw, value in ((b'{"prefill_token_ratio": NaN}', "NaN"), (b'{"prefill_token_ratio": Infinity}', "Infinity"),
                       (b'{"max_num_seqs": -Infinity}', "-Infinity")):
        response = httpx.patch(server.url + "/admin/config", content=raw, headers=AUTH)
        assert response.status_code == 422
        error = strict_json(response.text)["error"]
        assert error["value"] == value and error["knob"] in raw.decode()
    assert httpx.get(server.url + "/admin/config", headers=AUTH).json() == before


def test_requests_running_at_the_shutdown_deadline_end_with_an_abort_event(server: InProcessServer) -> None:
    body = {"prompt": "Count slowly:", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}

    async def run() -> tuple[list[dict[str, Any]], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            streams = [asyncio.ensure_future(stream_completion(http, body)) for _ in range(3)]
            whole = asyncio.ensure_future(http.post("/v1/completions", json=body))
            while server.engine.scheduler.num_running < 4:
                await asyncio.sleep(0.02)
            stopper = threading.Thread(target=server.stop)  # should_exit, as SIGTERM sets it
            stopper.start()
            results = list(await asyncio.gather(*streams))
            response = await whole
            await asyncio.to_thread(stopper.join, 60)
            return results, response

    streamed, whole = asyncio.run(run())
    for result in streamed:
        assert result["status"] == 200 and result["done"], result
        assert result["finish_reason"] == "abort"
        assert 0 < result["usage"]["completion_tokens"] < 4000
    assert whole.status_code == 200 and whole.json()["choices"][0]["finish_reason"] == "abort"
    assert server.engine.scheduler.kv.num_used_blocks == 0
