"""Request-body fuzzing (hypothesis) of the OpenAI endpoints and the admin API: whatever the body, the answer is
a 2xx or a 4xx with a reason (never a 500), a stream always ends with [DONE], and the server stays alive."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from server_helpers import InProcessServer

TOKEN = "fuzz-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
ALLOWED = {200, 400, 404, 413, 422, 429}
FUZZ = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def server() -> InProcessServer:
    # A short context keeps every accepted request short; a small KV pool cap keeps fuzzed pools small.
    s = InProcessServer(admin_token=TOKEN, max_body_bytes=16 * 1024, max_kv_memory_bytes=512 << 20,
                        max_model_len=96, kv_cache_bytes=64 << 20, swap_space_bytes=64 << 20)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server: InProcessServer) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 40),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=8)
token_ids = st.lists(st.one_of(st.integers(0, 49151), st.integers(-5, 10**6)), max_size=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "user", "bot"])},
                                optional={"content": st.one_of(st.text(max_size=30),
                                                               st.lists(st.fixed_dictionaries(
                                                                   {"type": st.just("text"),
                                                                    "text": st.text(max_size=10)}), max_size=2))})
# Mostly-valid bodies with 0-2 fields replaced by junk reach deep into the server; pure junk tests the parser.
valid_sampling = {
    "model": st.just("SmolLM2-135M-Instruct.Q4_1"),
    "max_tokens": st.integers(1, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 60),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=2)),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "priority": st.integers(-5, 5),
}
junk = {
    "model": json_values,
    "max_tokens": st.one_of(st.integers(-2, 0), st.integers(10**3, 10**30), json_values),
    "temperature": st.one_of(st.floats(-1e9, 1e9), json_values),
    "top_p": st.one_of(st.floats(-0.5, 1.5), json_values),
    "top_k": st.one_of(st.integers(-(2**70), 2**70), json_values),
    "seed": st.one_of(st.integers(-(2**70), 2**70), json_values),
    "stop": json_values,
    "stop_token_ids": st.one_of(token_ids, json_values),
    "ignore_eos": json_values,
    "min_tokens": st.one_of(st.integers(-2, 10), json_values),
    "n": st.one_of(st.integers(-1, 3), json_values),
    "stream": json_values,
    "stream_options": json_values,
    "priority": st.one_of(st.integers(-(2**70), 2**70), json_values),
    "logprobs": json_values, "presence_penalty": json_values, "logit_bias": json_values, "user": json_values,
    "echo": json_values, "suffix": json_values, "best_of": json_values, "max_completion_tokens": json_values,
    "tools": json_values, "response_format": json_values, "prompt": json_values, "messages": json_values,
}


def mutated(base: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
    junk_fields = st.sampled_from(sorted(junk)).flatmap(lambda key: st.tuples(st.just(key), junk[key]))
    return st.one_of(
        st.builds(lambda body, bad: {**body, **dict(bad)}, base, st.lists(junk_fields, max_size=2)),
        json_values)


valid_prompt = st.one_of(st.text(max_size=40), st.lists(st.integers(0, 49151), min_size=1, max_size=12),
                         st.lists(st.one_of(st.text(min_size=1, max_size=10),
                                            st.lists(st.integers(0, 49151), min_size=1, max_size=5)),
                                  min_size=1, max_size=3))
# max_tokens is always drawn (small) in the valid part, so that accepted requests stay short.
optional_sampling = {k: v for k, v in valid_sampling.items() if k != "max_tokens"}
completion_bodies = mutated(st.fixed_dictionaries({"prompt": valid_prompt, "max_tokens": st.integers(1, 4)},
                                                  optional=optional_sampling))
chat_bodies = mutated(st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=2),
                                             "max_tokens": st.integers(1, 4)},
                                            optional={**optional_sampling, "max_completion_tokens": st.integers(1, 4)}))
knob_names = ["max_num_seqs", "max_num_batched_tokens", "chunk_size", "prefill_token_ratio", "block_size",
              "num_kv_blocks", "kv_cache_bytes", "max_model_len", "preemption_mode", "swap_space_bytes",
              "enable_prefix_caching", "scheduling_policy", "generation", "bogus"]
knob_values = st.one_of(scalars, st.integers(1, 512), st.integers(1, 64), st.sampled_from(["recompute", "swap",
                                                                                          "fcfs", "priority"]),
                        st.floats(0, 1.5, allow_nan=False), st.integers(1 << 20, 1 << 40), json_values)
admin_bodies = st.one_of(st.dictionaries(st.sampled_from(knob_names), knob_values, max_size=3), json_values)


def check(server: InProcessServer, response: httpx.Response) -> None:
    assert response.status_code in ALLOWED, (response.status_code, response.text)
    event(f"status {response.status_code}")
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert not any('"error"' in e[:10] for e in events), events
    assert server.engine_loop.alive


def post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    return http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


@FUZZ
@given(body=completion_bodies)
def test_completions_fuzz(server: InProcessServer, http: httpx.Client, body: Any) -> None:
    check(server, post(http, "/v1/completions", body))


@FUZZ
@given(body=chat_bodies)
def test_chat_fuzz(server: InProcessServer, http: httpx.Client, body: Any) -> None:
    check(server, post(http, "/v1/chat/completions", body))


@FUZZ
@given(raw=st.one_of(st.binary(max_size=64), st.sampled_from(
    [b"", b"{", b"NaN", b'{"prompt": NaN}', b'{"prompt": "x", "max_tokens": Infinity}', b'{"prompt": "\\ud800"}',
     b'{"messages": [{"role": "user", "content": "\\udfff"}]}', b"[" * 5000 + b"]" * 5000, b"x" * 20000])),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/admin/config"]))
def test_raw_bytes_fuzz(server: InProcessServer, http: httpx.Client, raw: bytes, path: str) -> None:
    if path == "/admin/config":
        response = http.patch(path, content=raw, headers=AUTH)
    else:
        response = http.post(path, content=raw)
    check(server, response)


@FUZZ
@given(body=admin_bodies)
def test_admin_fuzz(server: InProcessServer, http: httpx.Client, body: Any) -> None:
    original = http.get("/admin/config", headers=AUTH).json()["config"]
    response = http.patch("/admin/config", content=json.dumps(body).encode(), headers=AUTH)
    check(server, response)
    if response.status_code == 200 and response.json()["config"] != original:
        assert http.patch("/admin/config", json=original, headers=AUTH).status_code == 200


def test_still_serving_after_fuzzing(server: InProcessServer, http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["num_running"] == 0 and health["kv_cache_usage"] == 0
