"""The fused layer loop (engine/fused_layers.cpp) computes exactly what the Python layer loop computes: same hidden
states, same KV cache writes, bit for bit, so greedy outputs stay token-identical to transformers."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.attention import AttentionMetadata, DecodeGroup, PrefillChunk


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=8, max_num_batched_tokens=128, block_size=16)


def decode_only() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Three sequences decoding (contexts 33, 40, 57 with the new token: the shorter ones masked)."""
    contexts = [33, 40, 57]
    tables = torch.tensor([[0, 1, 2, 0], [3, 4, 5, 0], [6, 7, 8, 9]])
    slots = torch.tensor([int(tables[i, (c - 1) // 16]) * 16 + (c - 1) % 16 for i, c in enumerate(contexts)])
    mask = (torch.arange(57)[None, :] < torch.tensor(contexts)[:, None])[:, None, None, :]
    meta = AttentionMetadata(slot_mapping=slots, decode_groups=[DecodeGroup(0, 3, tables, 57, mask)])
    return torch.tensor([1200, 7, 31000]), torch.tensor(contexts) - 1, meta


def mixed() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Two decode groups (one sequence each), a first prefill chunk (nothing cached) and a later chunk of a
    sequence with 20 tokens cached."""
    ids, positions, slots = [5, 9], [29, 139], [10 * 16 + 13, 20 * 16 + 11]
    groups = [DecodeGroup(0, 1, torch.tensor([[10, 11]]), 30, None),
              DecodeGroup(1, 2, torch.tensor([[12 + i for i in range(8)] + [20]]), 140, None)]
    first = list(range(6))  # a 6-token prompt's first chunk, blocks 30
    ids += [100 + i for i in first]
    positions += first
    slots += [30 * 16 + i for i in first]
    later = list(range(20, 28))  # tokens 20..27 of a sequence on blocks 40, 41
    ids += [300 + i for i in later]
    positions += later
    slots += [(40 + p // 16) * 16 + p % 16 for p in later]
    chunk_positions = torch.tensor(later)
    chunks = [PrefillChunk(2, 8, 6, torch.tensor([30]), None),
              PrefillChunk(8, 16, 28, torch.tensor([40, 41]), torch.arange(28)[None, :] <= chunk_positions[:, None])]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), decode_groups=groups, prefills=chunks)
    return torch.tensor(ids), torch.tensor(positions), meta


@pytest.mark.parametrize("batch", [decode_only, mixed])
def test_fused_layer_loop_is_bit_identical_to_the_python_loop(llm: LLM, batch) -> None:  # type: ignore[no-untyped-def]
    model, kv = llm.engine.model, llm.engine.runner.kv_cache
    assert model.fused is not None, "the fused layer loop was not built (it needs g++ and ninja)"
    generator = torch.Generator().manual_seed(0)
    kv.key.copy_(torch.randn(kv.key.shape, generator=generator))  # cached context
    kv.value.copy_(torch.randn(kv.value.shape, generator=generator))
    ids, positions, meta = batch()
    key0, value0 = kv.key.clone(), kv.value.clone()

    fused_hidden = model.forward(ids, positions, meta, kv)
    fused_key, fused_value = kv.key.clone(), kv.value.clone()
    kv.key.copy_(key0)
    kv.value.copy_(value0)
    fused, model.fused = model.fused, None
    try:
        python_hidden = model.forward(ids, positions, meta, kv)
    finally:
        model.fused = fused
    assert torch.equal(fused_hidden, python_hidden)
    assert torch.equal(fused_key, kv.key) and torch.equal(fused_value, kv.value)
    assert not torch.equal(key0, kv.key)  # the step did write the new tokens' keys
