"""Greedy output identical, token for token, to transformers' `generate` (both in float32), under every scheduling and
cache layout that changes how the work is cut up: chunked prefill, block sizes, preemption (recompute and swap),
prefix caching, and a live config update in the middle of generation. (bf16: tests/test_bf16.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from engine import LLM, SamplingParams
from tests.conftest import REFERENCE_MAX_TOKENS

GREEDY = SamplingParams(max_tokens=REFERENCE_MAX_TOKENS, temperature=0.0)

# A pool of 24 blocks of 16 tokens holds a few sequences at a time: preemption is certain.
SMALL_POOL: dict[str, Any] = dict(num_kv_blocks=24, block_size=16, max_model_len=384)


def run(mixed_prompts: list[list[int]], **knobs: Any) -> tuple[LLM, list[list[int]]]:
    llm = LLM(dtype="float32", **{"max_num_seqs": 16, "max_num_batched_tokens": 256, **knobs})
    outputs = llm.generate(mixed_prompts, GREEDY)
    assert all(o.finished for o in outputs)
    assert llm.engine.scheduler.kv.num_used_blocks == 0, "KV blocks leaked"
    return llm, [o.token_ids for o in outputs]


def assert_same(got: list[list[int]], expected: list[list[int]]) -> None:
    bad = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not bad, f"prompts {bad} differ from transformers, e.g. {got[bad[0]]} != {expected[bad[0]]}"


# chunk size 1 (every prompt token its own step) is slow: the slow suite; chunk 7 also splits every prompt
@pytest.mark.parametrize("chunk_size", [pytest.param(1, marks=pytest.mark.slow), 7, None],
                         ids=["chunk1", "chunk7", "unbounded"])
def test_chunked_prefill_matches_transformers(mixed_prompts, reference_outputs, chunk_size) -> None:
    llm, got = run(mixed_prompts, chunk_size=chunk_size)
    assert_same(got, reference_outputs)
    records = llm.step_records()
    if chunk_size is not None:
        assert max(r.num_prefill_tokens for r in records) <= chunk_size * 16
    # Prefill and decode tokens share steps (continuous batching, not prefill-then-decode).
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in records)


# 16, the engine's default, is the block size of every other test here
@pytest.mark.parametrize("block_size", [1, 32])
def test_block_sizes_match_transformers(mixed_prompts, reference_outputs, block_size) -> None:
    _, got = run(mixed_prompts, block_size=block_size)
    assert_same(got, reference_outputs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches_transformers(mixed_prompts, reference_outputs, mode) -> None:
    llm, got = run(mixed_prompts, preemption_mode=mode, **SMALL_POOL)
    assert_same(got, reference_outputs)
    records = llm.step_records()
    assert sum(r.num_preemptions for r in records) > 0, "the small pool should force preemption"
    if mode == "swap":
        assert sum(r.num_swapped_blocks for r in records) > 0, "swap mode should copy blocks to the host pool"
        assert llm.engine.scheduler.kv.host_pool.num_free == llm.engine.scheduler.kv.host_pool.num_blocks


def test_prefix_caching_matches_transformers(mixed_prompts, reference_outputs) -> None:
    # Few sequences at a time, so later prompts find the shared prefix already cached.
    llm, got = run(mixed_prompts, enable_prefix_caching=True, max_num_seqs=4)
    assert_same(got, reference_outputs)
    hits = sum(r.prefix_cache_hit_tokens for r in llm.step_records())
    assert hits >= 5 * 64, f"prompts sharing a ~90-token prefix should hit the cache, got {hits} tokens"
    llm_off, got_off = run(mixed_prompts, enable_prefix_caching=False, max_num_seqs=4)
    assert_same(got_off, reference_outputs)
    assert sum(r.prefix_cache_hit_tokens for r in llm_off.step_records()) == 0


def test_live_config_update_mid_generation(mixed_prompts, reference_outputs) -> None:
    llm = LLM(dtype="float32", max_num_seqs=16, max_num_batched_tokens=256, chunk_size=32, block_size=16)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in mixed_prompts]
    done: dict[str, list[int]] = {}

    def step_until(condition) -> None:
        while not condition():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids

    step_until(lambda: any(r.num_decode_tokens > 0 for r in llm.step_records()) and len(llm.step_records()) >= 12)
    assert engine.scheduler.num_unfinished > 0
    new = llm.update_config(block_size=32, max_num_seqs=8, chunk_size=7, max_num_batched_tokens=128,
                            prefill_token_ratio=0.5, preemption_mode="swap")
    assert new.generation == 1 and llm.config.block_size == 32
    step_until(lambda: len(done) >= 12)
    llm.update_config(num_kv_blocks=16, max_model_len=512, enable_prefix_caching=False, scheduling_policy="priority")
    step_until(lambda: not engine.has_unfinished_requests())
    assert_same([done[i] for i in ids], reference_outputs)
    generations = [r.config_generation for r in llm.step_records()]
    assert generations == sorted(generations) and generations[0] == 0 and generations[-1] == 2
    assert engine.scheduler.kv.num_used_blocks == 0
