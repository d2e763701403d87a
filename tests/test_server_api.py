"""The OpenAI-compatible API through the official `openai` client, the metrics against what was sent, bad input,
failure isolation, disconnects and slow clients: one in-process server (uvicorn in a thread) for the module."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import httpx
import openai
import pytest
from server_helpers import InProcessServer, delta, metric, scrape, stream_completion

from engine import metric_names
from engine.metrics import LENGTH_BUCKETS

PROMPT = "The capital of France is"
MAX_BODY = 256 * 1024


async def engine_holds_a_request(server: InProcessServer, timeout_s: float = 60.0) -> None:
    """Return once the engine holds a request (one a test just sent); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not server.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, f"the engine held no request after {timeout_s:.0f}s"
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def server() -> InProcessServer:
    s = InProcessServer(max_body_bytes=MAX_BODY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def stream_texts(chunks: Any) -> tuple[list[str], Any, str | None]:
    """Texts of the token events, the usage, the last finish reason."""
    texts, usage, reason = [], None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts.append(choice.text if hasattr(choice, "text") else (choice.delta.content or ""))
            reason = choice.finish_reason or reason
    return texts, usage, reason


# The API --------------------------------------------------------------------------------------------------------
def test_models_and_health(server: InProcessServer, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok"


def test_the_first_request_of_the_serving_page_is_answered(server: InProcessServer) -> None:
    """docs/serving.md's first curl, its body as written there, gets a stream (not a 404 for the model's name)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "serving.md").read_text()
    body = json.loads(page.split("-d '", 1)[1].split("'", 1)[0])
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and "data: [DONE]" in r.text, r.text[:300]


def test_completion_stream_equals_non_stream_and_exact_lengths(server: InProcessServer,
                                                               client: openai.OpenAI) -> None:
    extra = {"ignore_eos": True}
    whole = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=10, temperature=0,
                                      extra_body=extra)
    assert whole.usage.completion_tokens == 10
    assert whole.choices[0].finish_reason == "length"
    texts, usage, reason = stream_texts(client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True, extra_body=extra))
    assert len(texts) == 10  # one event per token
    assert "".join(texts) == whole.choices[0].text
    assert usage.completion_tokens == 10 and usage.prompt_tokens == whole.usage.prompt_tokens
    assert reason == "length"


def test_chat_stream_equals_non_stream(server: InProcessServer, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens <= 12
    texts, usage, reason = stream_texts(client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=12, temperature=0, stream=True))
    assert "".join(texts) == whole.choices[0].message.content
    assert len(texts) == usage.completion_tokens == whole.usage.completion_tokens
    assert reason == whole.choices[0].finish_reason
    forced = client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=7,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 7


def test_token_id_prompts_and_batches(server: InProcessServer, client: openai.OpenAI) -> None:
    ids = server.engine.tokenize(PROMPT)
    by_text = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model=server.model, prompt=[ids, "Hello"], max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text[: len(batch.choices[0].text)]
    assert batch.usage.completion_tokens == 8


def test_sampling_options(server: InProcessServer, client: openai.OpenAI) -> None:
    base = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base.strip().split()[1] if len(base.strip().split()) > 1 else base.strip()[:2]
    stopped = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text and base.startswith(stopped.choices[0].text)
    seeded = [client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=1.0,
                                        top_p=0.9, seed=7, extra_body={"top_k": 20}).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    eos_free = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Say OK."}],
                                              max_tokens=6, temperature=0, extra_body={"min_tokens": 6})
    assert eos_free.usage.completion_tokens == 6


# Bad input ------------------------------------------------------------------------------------------------------
def test_bad_requests(server: InProcessServer, client: openai.OpenAI) -> None:
    max_len = server.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=server.model, prompt=[1] * (max_len + 10), max_tokens=1)
    assert str(max_len + 10) in str(too_long.value) and str(max_len) in str(too_long.value)
    with pytest.raises(openai.BadRequestError) as overflow:
        client.completions.create(model=server.model, prompt=[1] * 100, max_tokens=max_len)
    assert "100 in the prompt" in str(overflow.value)
    for bad in ({"temperature": -1}, {"n": 2}, {"top_p": 0}, {"max_tokens": 0}, {"extra_body": {"min_tokens": 99}},
                {"extra_body": {"stop_token_ids": [10**6]}}, {"prompt": [10**7]}, {"prompt": []},
                {"extra_body": {"ignore_eos": "yes"}}, {"stop": [""]}):
        kwargs: dict[str, Any] = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, **bad}
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**kwargs)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=server.model, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=server.model, messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    raw = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30)
    assert raw.status_code == 400 and "JSON" in raw.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/completions", json=[1, 2], timeout=30).status_code == 400
    big = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * (MAX_BODY + 10)}, timeout=30)
    assert big.status_code == 413
    assert httpx.get(server.url + "/debug/steps", params={"since": "abc"}).status_code == 400
    assert httpx.get(server.url + "/admin/config").status_code == 403  # no token configured: always refused
    assert httpx.patch(server.url + "/admin/config", json={"max_num_seqs": 4},
                       headers={"authorization": "Bearer x"}).status_code == 403
    assert httpx.get(server.url + "/health").status_code == 200


def test_queue_bound_gives_429(server: InProcessServer, client: openai.OpenAI) -> None:
    loop = server.engine_loop
    bound = loop.max_waiting_requests
    # The bound counts requests waiting beyond the free running slots: one slot, held by a running stream.
    slots = server.engine.config.max_num_seqs
    in_engine_loop(server, loop.update_config({"max_num_seqs": 1}))
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as holder:
        lines = holder.iter_lines()  # kept open: a closed iterator would close the connection
        next(lines)  # its first token: it runs
        loop.max_waiting_requests = 0
        try:
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2)
        finally:
            loop.max_waiting_requests = bound
        lines.close()
    in_engine_loop(server, loop.update_config({"max_num_seqs": slots}))
    assert client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1


def in_engine_loop(server: InProcessServer, command: Any) -> Any:
    """Run an `EngineLoop` coroutine on the server's event loop from the test's thread."""
    return asyncio.run_coroutine_threadsafe(command, server.engine_loop._loop).result(60)


# Metrics --------------------------------------------------------------------------------------------------------
def test_metrics_agree_with_what_was_sent(server: InProcessServer) -> None:
    first_step = httpx.get(server.url + "/health").json()["last_step"]
    before = scrape(server.url)
    lengths = [3, 5, 7, 2, 4, 6]
    prompts = ["Hello there", "Tell me about the sea", PROMPT, "1 2 3 4", "Why is the sky blue?", "def f(x):"]

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            jobs = []
            for i, (prompt, n) in enumerate(zip(prompts, lengths)):
                body = {"model": server.model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                        "ignore_eos": True}
                if i % 2:
                    jobs.append(stream_completion(http, body))
                else:
                    jobs.append(_post_json(http, "/v1/completions", body))
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    after = scrape(server.url)
    usages = [r["usage"] for r in results]
    assert [u["completion_tokens"] for u in usages] == lengths
    expected_prompt_tokens = sum(len(server.engine.tokenize(p)) for p in prompts)
    assert sum(u["prompt_tokens"] for u in usages) == expected_prompt_tokens
    n = len(lengths)
    assert delta(before, after, "slotune_prompt_tokens_total") == expected_prompt_tokens
    assert delta(before, after, "slotune_generation_tokens_total") == sum(lengths)
    assert delta(before, after, "slotune_request_success_total", finished_reason="length") == n
    assert delta(before, after, "slotune_time_to_first_token_seconds_count") == n
    assert delta(before, after, "slotune_inter_token_latency_seconds_count") == sum(k - 1 for k in lengths)
    assert delta(before, after, "slotune_e2e_request_latency_seconds_count") == n
    assert delta(before, after, "slotune_request_itl_p99_seconds_count") == n  # one per finished request
    assert delta(before, after, "slotune_request_queue_time_seconds_count") == n
    # The per-request length histograms: one observation per finished request, its prompt and output lengths.
    prompt_lens = [len(server.engine.tokenize(p)) for p in prompts]
    for name, sent in (("slotune_request_prompt_tokens", prompt_lens), ("slotune_request_generation_tokens", lengths)):
        assert delta(before, after, f"{name}_count") == n
        assert delta(before, after, f"{name}_sum") == sum(sent)
        for le in LENGTH_BUCKETS:
            assert delta(before, after, f"{name}_bucket", le=str(float(le))) == sum(k <= le for k in sent), (name, le)
    assert delta(before, after, "slotune_http_responses_total", path="/v1/completions", code="200") == n
    # The step histograms agree with the step records of the same steps.
    steps = httpx.get(server.url + "/debug/steps", params={"since": first_step}).json()["steps"]
    assert delta(before, after, "slotune_step_duration_seconds_count") == len(steps)
    assert delta(before, after, "slotune_step_tokens_sum", phase="decode") == sum(s["num_decode_tokens"]
                                                                                   for s in steps)
    assert delta(before, after, "slotune_step_tokens_sum", phase="prefill") == sum(s["num_prefill_tokens"]
                                                                                    for s in steps)
    # Fine buckets: a 50 ms p99 is readable.
    for le in ("0.005", "0.01", "0.025", "0.05", "0.075", "0.1"):
        assert ("slotune_inter_token_latency_seconds_bucket", (("le", le),)) in after
    assert metric(after, "slotune_num_requests_running") == 0
    assert metric(after, "slotune_kv_cache_usage_ratio") == 0
    assert metric(after, "slotune_knob", name="block_size") == server.engine.config.block_size
    assert metric(after, "slotune_config_generation") == server.engine.config.generation
    # every name the readers take from the engine's table is a series the engine exports
    exported = {key[0] for key in after}
    for name in (v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)):
        assert any(e == name or e.startswith(name + "_") for e in exported), name


async def _post_json(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


# Faults ---------------------------------------------------------------------------------------------------------
def test_a_failing_request_fails_alone(server: InProcessServer, client: openai.OpenAI,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real_tokenize = server.engine.tokenize

    def tokenize(prompt: Any) -> list[int]:
        if prompt == "boom":
            raise RuntimeError("tokenizer exploded")
        return real_tokenize(prompt)

    monkeypatch.setattr(server.engine, "tokenize", tokenize)
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=server.model, prompt="boom", max_tokens=2)
    assert client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1

    # A step that raises fails the requests in flight, and the next ones are served.
    real_step = server.engine.step
    calls = {"n": 0}

    def step() -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("step exploded")
        return real_step()

    monkeypatch.setattr(server.engine, "step", step)

    async def run() -> tuple[dict[str, Any], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
            return await asyncio.gather(stream_completion(http, body), http.post("/v1/completions", json=body))

    streamed, whole = asyncio.run(run())
    assert "step exploded" in streamed["error"]["message"] and streamed["done"]
    assert whole.status_code == 500 and "step exploded" in whole.json()["error"]["message"]
    monkeypatch.setattr(server.engine, "step", real_step)
    assert client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 3
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["num_running"] == 0 and health["kv_cache_usage"] == 0


def test_disconnect_aborts_within_one_step(server: InProcessServer) -> None:
    before = scrape(server.url)

    async def run() -> float:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            # the keeper must still be decoding when the other client leaves, on a fast machine too: 200 tokens
            # are ~2 s of steps here, the disconnect takes a handful
            body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
            keeper = asyncio.ensure_future(stream_completion(http, body))
            await engine_holds_a_request(server)
            await stream_completion(http, {**body, "prompt": "Hello"}, stop_after=3)
            gone = time.time()
            assert not keeper.done(), "the keeper finished before the other client left: nothing is measured"
            assert len((await keeper)["texts"]) == 200
            return gone

    gone = asyncio.run(run())
    steps = [s for s in server.engine.step_records() if s.start_time > gone]
    assert steps, "the other request kept the engine stepping"
    both = [s for s in steps if s.num_running == 2]
    assert len(both) <= 1, f"the disconnected request ran {len(both)} more steps"
    after = scrape(server.url)
    assert delta(before, after, "slotune_request_success_total", finished_reason="abort") == 1
    assert metric(after, "slotune_kv_cache_usage_ratio") == 0 and metric(after, "slotune_num_requests_running") == 0


def test_the_engine_and_the_front_end_do_not_stall_each_other(server: InProcessServer, client: openai.OpenAI,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps go on while the event loop is blocked (a slow front end cannot stall a step), and connections are
    served while a step takes long (a step cannot stall the front end)."""
    loop = server.engine_loop._loop
    assert loop is not None

    async def run() -> tuple[float, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            # long enough to still be decoding after the 0.3 s below plus the 1.5 s block (~12 ms a step here)
            body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "temperature": 0}
            job = asyncio.ensure_future(stream_completion(http, body))
            await engine_holds_a_request(server)
            await asyncio.sleep(0.3)
            blocked = time.time()
            loop.call_soon_threadsafe(time.sleep, 1.5)  # the event loop thread does nothing else for 1.5 s
            await job
            return blocked, blocked + 1.5

    start, end = asyncio.run(run())
    inside = [s for s in server.engine.step_records() if start + 0.2 < s.start_time < end - 0.2]
    assert len(inside) >= 2, "the engine stopped stepping while the event loop was blocked"

    real_step = server.engine.step

    def slow_step() -> Any:
        time.sleep(1.0)  # a long step (sleep releases the GIL as torch does)
        return real_step()

    monkeypatch.setattr(server.engine, "step", slow_step)
    results: dict[str, float] = {}

    async def probe() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            body = {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
            job = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await engine_holds_a_request(server)
            t0 = time.monotonic()
            assert (await http.get("/health")).status_code == 200
            results["health_s"] = time.monotonic() - t0
            await job

    asyncio.run(probe())
    assert results["health_s"] < 0.5, f"/health took {results['health_s']:.2f} s during a 1 s step"


def test_a_slow_client_does_not_stall_the_engine(server: InProcessServer, client: openai.OpenAI) -> None:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "stream": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    slow.connect(("127.0.0.1", server.port))
    try:
        slow.sendall(request)  # ... and never read
        other = client.completions.create(model=server.model, prompt="Hello", max_tokens=4,
                                          extra_body={"ignore_eos": True})
        assert other.usage.completion_tokens == 4
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            health = httpx.get(server.url + "/health").json()
            if health["num_running"] == 0 and health["num_waiting"] == 0:
                break
            time.sleep(0.1)
        assert health["num_running"] == 0, "the engine waited for the slow reader"
    finally:
        slow.close()
