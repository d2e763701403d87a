"""The Triton kernels (engine/triton_kernels/) compute what the engine's torch path computes: paged decode attention
(block sizes 1, 16, 32; grouped-query heads; contexts ending inside a block and on its edge; the split-context
path), variable-length prefill attention (a first chunk, a chunk in the middle of a sequence, several sequences
per launch, beside decodes), RMS norm with the residual add, rotary embedding with the KV-cache write, SiLU * up,
and a whole forward pass of a small random model. Without a GPU they run under Triton's interpreter
(TRITON_INTERPRET=1, set by tests/triton_interpreter.py before triton is imported), in fp32 and fp16 (the
interpreter's bf16 dots are wrong). The metadata comes from the engine's own ModelRunner, once as the torch path lays it out (decode groups by
context spread, masks) and once as the Triton path does (one group, no masks)."""

from __future__ import annotations

from tests.triton_interpreter import DEVICE  # isort: skip  (first: it switches the interpreter on)

import random

import pytest
import torch
import torch.nn.functional as F

from engine import attention
from engine import triton_kernels as tk
from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model import LlamaModel
from engine.model_loader import ModelConfig
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSequence
from engine.sequence import Sequence
from engine.triton_kernels.decode_attention import BLOCK_N
from engine.triton_kernels.prefill_attention import TILES
DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=2e-3)}
NUM_BLOCKS = 160
# (query heads, KV heads): grouped-query (SmolLM2's 3 per KV head), multi-head, one KV head for all.
HEADS = [(6, 2), (4, 4), (8, 1)]
# Every block size and head layout in fp32; fp16 with grouped-query heads.
ATTENTION_CASES = [pytest.param(block_size, heads, torch.float32, id=f"bs{block_size}-{name}-fp32")
                   for block_size in (1, 16, 32) for heads, name in zip(HEADS, ("gqa3", "mha", "mqa"))] + [
                   pytest.param(block_size, HEADS[0], torch.float16, id=f"bs{block_size}-gqa3-fp16")
                   for block_size in (1, 16, 32)]
# Decode contexts (the new token included): inside a block, on block edges, one token, a long one.
DECODE_CONTEXTS = [1, 15, 16, 17, 33, 70, 200]
# Prefill chunks as (cached tokens, chunk tokens): first chunks and chunks in the middle of a sequence.
PREFILLS = [(0, 5), (20, 13), (0, 40), (47, 17)]


def tiny_config(heads: int = 6, kv_heads: int = 2, head_dim: int = 16) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=300, hidden_size=heads * head_dim, intermediate_size=160,
                       num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024,
                       tie_word_embeddings=True, attention_bias=True, eos_token_ids=(), bos_token_id=None)


def tiny_state(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d

    def rand(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    state = {"model.embed_tokens.weight": rand(config.vocab_size, h, scale=1.0), "model.norm.weight": 1 + rand(h)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        state.update({p + "input_layernorm.weight": 1 + rand(h), p + "post_attention_layernorm.weight": 1 + rand(h),
                      p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                      p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                      p + "self_attn.q_proj.bias": rand(q), p + "self_attn.k_proj.bias": rand(kv),
                      p + "self_attn.v_proj.bias": rand(kv), p + "mlp.gate_proj.weight": rand(i, h),
                      p + "mlp.up_proj.weight": rand(i, h), p + "mlp.down_proj.weight": rand(h, i)})
    return state


def models(dtype: torch.dtype, heads: tuple[int, int] = (6, 2)) -> tuple[LlamaModel, LlamaModel]:
    """The same small random model on the torch path and on the Triton kernels."""
    config = tiny_config(*heads)
    state = tiny_state(config)
    return (LlamaModel(config, state, dtype, DEVICE, kernel_backend="torch"),
            LlamaModel(config, state, dtype, DEVICE, kernel_backend="triton"))


def random_cache(config: ModelConfig, block_size: int, dtype: torch.dtype, seed: int = 1) -> KVCache:
    cache = KVCache(config.num_hidden_layers, NUM_BLOCKS * 16 // block_size, block_size, config.num_key_value_heads,
                    config.head_dim, dtype, DEVICE)
    generator = torch.Generator().manual_seed(seed)
    cache.key.copy_(torch.randn(cache.key.shape, generator=generator))
    cache.value.copy_(torch.randn(cache.value.shape, generator=generator))
    return cache


def schedule(block_size: int, num_blocks: int, decode_contexts: list[int], prefills: list[tuple[int, int]],
             seed: int = 2) -> list[ScheduledSequence]:
    """Sequences on distinct, shuffled blocks: decodes (context = computed tokens + the new one), then chunks."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    scheduled = []
    for kind, specs in (("decode", [(c - 1, 1) for c in decode_contexts]), ("prefill", prefills)):
        for cached, new in specs:
            end = cached + new
            seq = Sequence(request_id=f"{kind}-{len(scheduled)}", prompt_token_ids=[rng.randrange(300)
                                                                                   for _ in range(end)],
                           params=SamplingParams(max_tokens=4))
            seq.num_computed_tokens = cached
            seq.block_table = [free.pop() for _ in range(-(-end // block_size))]
            scheduled.append(ScheduledSequence(seq, new, is_prefill=kind == "prefill", samples=True))
    return scheduled


def prepared(model: LlamaModel, cache: KVCache, scheduled: list[ScheduledSequence]
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    _, ids, positions, meta = ModelRunner(model, cache)._prepare(scheduled)
    return ids, positions, meta


def attention_inputs(heads: tuple[int, int], block_size: int, dtype: torch.dtype, decode_contexts: list[int],
                     prefills: list[tuple[int, int]]
                     ) -> tuple[torch.Tensor, KVCache, AttentionMetadata, AttentionMetadata, torch.Tensor]:
    """A random query for a scheduled batch, a random layer-0 cache, the torch path's and the Triton path's
    metadata, and the reference output of engine/attention.py's paged_attention."""
    torch_model, triton_model = models(dtype, heads)
    cache = random_cache(torch_model.config, block_size, dtype)
    scheduled = schedule(block_size, cache.num_blocks, decode_contexts, prefills)
    _, _, torch_meta = prepared(torch_model, cache, scheduled)
    _, _, triton_meta = prepared(triton_model, cache, scheduled)
    tokens = torch_meta.slot_mapping.shape[0]
    query = torch.randn(tokens, heads[0], 16, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    flat_key = cache.key[0].view(-1, heads[1], 16)
    flat_value = cache.value[0].view(-1, heads[1], 16)
    new_key, new_value = flat_key[torch_meta.slot_mapping], flat_value[torch_meta.slot_mapping]
    expected = attention.paged_attention(query, new_key, new_value, cache.key[0], cache.value[0], torch_meta, 0.25)
    return query, cache, torch_meta, triton_meta, expected


@pytest.mark.parametrize(("block_size", "heads", "dtype"), ATTENTION_CASES)
def test_decode_attention_matches_the_torch_path(block_size: int, heads: tuple[int, int],
                                                 dtype: torch.dtype) -> None:
    query, cache, torch_meta, triton_meta, expected = attention_inputs(heads, block_size, dtype, DECODE_CONTEXTS,
                                                                       [])
    assert len(torch_meta.decode_groups) > 1 and len(triton_meta.decode_groups) == 1
    got = tk.paged_attention(query, cache.key[0], cache.value[0], tk.TritonBatch.from_metadata(triton_meta, DEVICE),
                             0.25)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    group = triton_meta.decode_groups[0]
    # The split-context path (slices merged after) and the GPU's tile size, wherever this runs.
    for splits, block_n in ((3, None), (7, BLOCK_N), (1, BLOCK_N)):
        split = tk.decode_attention(query, cache.key[0], cache.value[0], group.block_tables, group.context_lens,
                                    0.25, group.context_len, num_splits=splits, block_n=block_n)
        torch.testing.assert_close(split, expected, **TOLERANCE[dtype])


def test_decode_attention_of_an_empty_context_is_zero() -> None:
    """A padded row (context 0, as in a captured CUDA graph's unused rows) gets zeros, not NaN."""
    query, cache, _, triton_meta, expected = attention_inputs((6, 2), 16, torch.float32, [17, 40], [])
    group = triton_meta.decode_groups[0]
    lens = group.context_lens.clone()
    lens[0] = 0
    for splits in (1, 2):
        got = tk.decode_attention(query, cache.key[0], cache.value[0], group.block_tables, lens, 0.25, 40,
                                  num_splits=splits)
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        torch.testing.assert_close(got[1], expected[1])


@pytest.mark.parametrize(("block_size", "heads", "dtype"), ATTENTION_CASES)
def test_prefill_attention_matches_the_torch_path(block_size: int, heads: tuple[int, int],
                                                  dtype: torch.dtype) -> None:
    """Several chunks per launch (first chunks and chunks after cached context) beside decodes, as one step."""
    query, cache, _, triton_meta, expected = attention_inputs(heads, block_size, dtype, [9, 33], PREFILLS)
    batch = tk.TritonBatch.from_metadata(triton_meta, DEVICE)
    assert batch.prefill_lens.tolist() == [new for _, new in PREFILLS]
    got = tk.paged_attention(query, cache.key[0], cache.value[0], batch, 0.25)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    gpu_tiles = torch.zeros_like(query)  # the GPU's tile sizes, wherever this runs
    tk.prefill_attention(query, cache.key[0], cache.value[0], batch.prefill_tables, batch.prefill_starts,
                         batch.prefill_lens, batch.prefill_contexts, batch.max_prefill_len, 0.25, gpu_tiles,
                         tiles=TILES)
    torch.testing.assert_close(gpu_tiles[2:], expected[2:], **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_rms_norm_with_and_without_the_residual_matches_the_torch_path(dtype: torch.dtype) -> None:
    torch_model, _ = models(dtype)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(37, 96, generator=generator).to(DEVICE, dtype)
    residual = torch.randn(37, 96, generator=generator).to(DEVICE, dtype)
    weight = torch_model.layers[0].input_norm
    eps = torch_model.config.rms_norm_eps
    torch.testing.assert_close(tk.rms_norm(x, weight, eps), torch_model._rms_norm(x, weight), **TOLERANCE[dtype])
    summed = residual + x
    in_place = residual.clone()
    normed = tk.rms_norm(x, weight, eps, residual=in_place)
    assert torch.equal(in_place, summed)  # residual += x, rounded like torch's add
    torch.testing.assert_close(normed, torch_model._rms_norm(summed, weight), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_rotary_and_cache_write_match_the_torch_path(block_size: int, dtype: torch.dtype) -> None:
    torch_model, _ = models(dtype)
    cfg = torch_model.config
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    positions = torch.tensor([0, 1, 15, 16, 17, 200, 511, 3], device=DEVICE)
    slots = torch.tensor([5, 6, 20, 21, 700, 3, 1000, -1], device=DEVICE)  # -1: a padded row, not written
    qkv = torch.randn(8, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    cos, sin = torch_model._rope(positions)
    expected_cache, got_cache = (random_cache(cfg, block_size, dtype) for _ in range(2))
    # The torch path of LlamaModel.forward: rotate queries and keys together, write keys and values.
    qk, v = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
    qk = torch_model._apply_rope(qk.reshape(8, heads + kv_heads, dim), cos, sin)
    q, k = qk.split([heads, kv_heads], dim=1)
    expected_cache.write(0, slots[:-1], k[:-1], v.reshape(8, kv_heads, dim)[:-1])
    got_q = tk.rotary_cache_write(qkv, cos, sin, slots, got_cache.key[0], got_cache.value[0], heads, kv_heads, dim)
    torch.testing.assert_close(got_q, q, **TOLERANCE[dtype])
    torch.testing.assert_close(got_cache.key, expected_cache.key, **TOLERANCE[dtype])
    assert torch.equal(got_cache.value, expected_cache.value)  # copied, untouched at slot -1


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_silu_and_mul_matches_the_torch_path(dtype: torch.dtype) -> None:
    gate_up = torch.randn(45, 2 * 160, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(tk.silu_and_mul(gate_up), F.silu(gate) * up, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_forward_on_the_triton_kernels_matches_the_torch_path(block_size: int, dtype: torch.dtype) -> None:
    """One mixed step (decodes and chunks) through a 2-layer model: hidden states and the KV cache it leaves."""
    torch_model, triton_model = models(dtype)
    scheduled = schedule(block_size, NUM_BLOCKS * 16 // block_size, [1, 16, 17, 70], PREFILLS)
    results = []
    for model in (torch_model, triton_model):
        cache = random_cache(model.config, block_size, dtype)
        ids, positions, meta = prepared(model, cache, scheduled)
        hidden = model.forward(ids, positions, meta, cache)
        results.append((hidden, model.compute_logits(hidden), cache))
    (hidden, logits, cache), (got_hidden, got_logits, got_cache) = results
    loose = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-2, atol=2e-2)}[dtype]
    torch.testing.assert_close(got_hidden, hidden, **loose)
    # fp16 logits of up to ~30: a few units in the last place of fp16 there (0.016 each)
    torch.testing.assert_close(got_logits, logits, **(loose if dtype == torch.float32 else dict(rtol=2e-2, atol=8e-2)))
    torch.testing.assert_close(got_cache.key, cache.key, **loose)
    torch.testing.assert_close(got_cache.value, cache.value, **loose)



@pytest.mark.parametrize("block_size", [1, 16])
def test_the_cuda_graph_buffers_and_padding_give_the_forward_pass(block_size: int) -> None:
    """A decode step of 3 sequences in a bucket of 4 (engine/cuda_graphs.py), captured and replayed on a GPU, its
    body run eagerly on a CPU: the padded rows write nothing to the cache, and the real rows' hidden states are the
    plain forward's."""
    from engine.cuda_graphs import CapturedDecode, bucket

    _, triton_model = models(torch.float32)
    scheduled = schedule(block_size, NUM_BLOCKS * 16 // block_size, [1, 17, 70], [])
    expected_cache, got_cache = (random_cache(triton_model.config, block_size, torch.float32) for _ in range(2))
    ids, positions, meta = prepared(triton_model, expected_cache, scheduled)
    expected = triton_model.forward(ids, positions, meta, expected_cache)
    captured = CapturedDecode(triton_model, got_cache, bucket(3), capture=DEVICE.type == "cuda")
    assert captured.size == 4
    got = captured.run(ids, positions, meta.decode_groups[0], meta.slot_mapping)
    torch.testing.assert_close(got, expected)  # close, not equal: matmuls of 4 rows may round unlike 3 rows'
    written = torch.zeros(got_cache.num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[meta.slot_mapping] = True
    for got_pool, expected_pool in ((got_cache.key, expected_cache.key), (got_cache.value, expected_cache.value)):
        flat_got, flat_expected = (pool.view(pool.shape[0], -1, *pool.shape[3:]) for pool in (got_pool,
                                                                                               expected_pool))
        assert torch.equal(flat_got[:, ~written], flat_expected[:, ~written])  # the padded rows wrote nothing
        torch.testing.assert_close(flat_got[:, written], flat_expected[:, written])
