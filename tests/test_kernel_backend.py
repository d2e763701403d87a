"""The `kernel_backend` knob: how `auto` resolves, the errors that name the knob, that it is a load-time choice, and
that the engine on the Triton kernels (under the interpreter without a GPU) gives transformers' greedy tokens with
the same steps as the default backend."""

from __future__ import annotations

from tests.triton_interpreter import DEVICE  # isort: skip  (first: it switches the interpreter on)

import logging
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig, ModelLimits
from engine.kernel_backend import cpp_unavailable_reason, resolve_kernel_backend

CPU = torch.device("cpu")
LIMITS = ModelLimits(max_context_len=2048, kv_bytes_per_token=1024)
# Of the shared prompts (tests/conftest.py): a 5-token and a 53-token one (the interpreter is slow: each step runs
# ~150 interpreted kernels); the slow tests add two that share a ~90-token prefix.
PROMPTS = [1, 5]
PREFIX_PROMPTS = [1, 5, 8, 9]
TOKENS = 6


def on_cpu() -> str:
    """What `auto` means on the CPU here: the C++ kernels where they build (g++ and torch's headers), else torch."""
    return "cpp" if cpp_unavailable_reason(CPU, torch.float32) is None else "torch"


def test_auto_resolves_by_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_kernel_backend("auto", CPU, torch.float32) == on_cpu()
    assert resolve_kernel_backend("auto", CPU, torch.bfloat16) == on_cpu()  # the C++ kernels take bf16 weights too
    assert resolve_kernel_backend("auto", CPU, torch.float16) == "torch"  # never the interpreter by itself
    expected_on_cuda = "triton" if torch.cuda.is_available() else "torch"
    assert resolve_kernel_backend("auto", torch.device("cuda"), torch.bfloat16) == expected_on_cuda
    monkeypatch.setenv("SLOTUNE_FUSED_LAYERS", "0")  # the old switch still turns the C++ loop off
    assert resolve_kernel_backend("auto", CPU, torch.float32) == "torch"
    with pytest.raises(ConfigError, match="kernel_backend.*SLOTUNE_FUSED_LAYERS=0"):
        resolve_kernel_backend("cpp", CPU, torch.float32)


def test_a_backend_that_cannot_run_is_a_config_error_naming_the_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="invalid kernel_backend='cuda'"):
        EngineConfig.create(LIMITS, kernel_backend="cuda")
    with pytest.raises(ConfigError, match="kernel_backend.*float32 or bfloat16 only"):
        resolve_kernel_backend("cpp", CPU, torch.float16)
    if DEVICE.type == "cpu":
        with pytest.raises(ConfigError, match="kernel_backend.*interpreter computes torch.bfloat16"):
            resolve_kernel_backend("triton", CPU, torch.bfloat16)
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ConfigError, match="kernel_backend.*set TRITON_INTERPRET=1"):
            resolve_kernel_backend("triton", CPU, torch.float32)
    assert resolve_kernel_backend("torch", CPU, torch.bfloat16) == "torch"


def test_the_backend_is_a_load_time_choice() -> None:
    config = EngineConfig.create(LIMITS)
    assert config.kernel_backend == "auto" and config.resolved_kernel_backend(CPU, torch.float32) == on_cpu()
    with pytest.raises(ConfigError, match="kernel_backend.*restart the engine"):
        config.updated(LIMITS, kernel_backend="torch")
    assert config.updated(LIMITS, kernel_backend="auto", max_num_seqs=8).max_num_seqs == 8  # same value: fine


def run(prompts: list[list[int]], **knobs: Any) -> tuple[LLM, list[list[int]]]:
    # float32: token-exact against transformers, and the interpreter's bf16 `tl.dot` is wrong
    llm = LLM(device=str(DEVICE), dtype="float32", **{"max_num_seqs": 4, "max_num_batched_tokens": 24,
                                                      "chunk_size": 16, "num_kv_blocks": 64, "max_model_len": 1024,
                                                      **knobs})
    outputs = llm.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0))
    assert llm.engine.scheduler.kv.num_used_blocks == 0, "KV blocks leaked"
    return llm, [o.token_ids for o in outputs]


def step_shape(llm: LLM) -> list[tuple[int, ...]]:
    return [(r.num_prefill_seqs, r.num_prefill_tokens, r.num_decode_tokens, r.num_running, r.kv_blocks_used,
             r.prefix_cache_hit_tokens) for r in llm.step_records()]


@pytest.mark.slow  # ~45 s under the interpreter; the kernels themselves are checked in the default suite
# (tests/test_triton_kernels.py)
def test_triton_backend_matches_transformers_with_the_same_steps(
        mixed_prompts: list[list[int]], reference_outputs: list[list[int]],
        caplog: pytest.LogCaptureFixture) -> None:
    """Chunked prefill (chunks of 16 after cached context), decodes beside chunks, block_size 16 with contexts
    crossing blocks: greedy tokens as transformers', steps as the default backend's."""
    prompts = [mixed_prompts[i] for i in PROMPTS]
    with caplog.at_level(logging.INFO, logger="slotune.engine"):
        llm, got = run(prompts, kernel_backend="triton")
    assert llm.engine.kernel_backend == "triton" and "kernel backend: triton" in caplog.text
    assert got == [reference_outputs[i][:TOKENS] for i in PROMPTS]
    default, default_got = run(prompts)
    assert default.engine.kernel_backend == ("triton" if DEVICE.type == "cuda" else on_cpu())
    assert default_got == got and step_shape(default) == step_shape(llm)
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in llm.step_records())


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [dict(block_size=1, num_kv_blocks=1024), dict(block_size=32, num_kv_blocks=32),
                                   dict(block_size=16, num_kv_blocks=12, max_num_batched_tokens=64, chunk_size=None)],
                         ids=["block1", "block32", "preemption"])
def test_triton_backend_matches_transformers_across_layouts(mixed_prompts: list[list[int]],
                                                            reference_outputs: list[list[int]],
                                                            knobs: dict[str, Any]) -> None:
    """Block sizes 1 and 32, a prefix-cache hit, and a pool so small that sequences are preempted."""
    prompts = [mixed_prompts[i] for i in PREFIX_PROMPTS]
    llm, got = run(prompts, kernel_backend="triton", max_model_len=192, **knobs)
    assert got == [reference_outputs[i][:TOKENS] for i in PREFIX_PROMPTS]
    records = llm.step_records()
    if knobs["num_kv_blocks"] == 12:
        assert sum(r.num_preemptions for r in records) > 0
    else:
        assert sum(r.prefix_cache_hit_tokens for r in records) > 0


@pytest.mark.slow
def test_triton_backend_relayouts_on_a_live_block_size_change(mixed_prompts: list[list[int]],
                                                              reference_outputs: list[list[int]]) -> None:
    llm = LLM(device=str(DEVICE), dtype="float32", kernel_backend="triton", max_num_seqs=4,
              max_num_batched_tokens=24, chunk_size=16, num_kv_blocks=64, max_model_len=1024)
    engine = llm.engine
    ids = [engine.add_request(mixed_prompts[i], SamplingParams(max_tokens=TOKENS, temperature=0.0))
           for i in PROMPTS]
    done: dict[str, list[int]] = {}
    while len(llm.step_records()) < 4:
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    llm.update_config(block_size=32, num_kv_blocks=32)
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert engine.runner.kv_cache.block_size == 32
    assert [done[i] for i in ids] == [reference_outputs[i][:TOKENS] for i in PROMPTS]
