"""The fused decode step (engine/fused_decode.cpp) computes exactly what the Python layer loop computes: same hidden
states, same KV cache writes, bit for bit, so greedy outputs stay token-identical to transformers."""

from __future__ import annotations

import torch

from engine import LLM
from engine.attention import AttentionMetadata, DecodeGroup


def test_fused_decode_step_is_bit_identical_to_the_python_layer_loop() -> None:
    llm = LLM(max_num_seqs=8, max_num_batched_tokens=128, block_size=16)
    model, kv = llm.engine.model, llm.engine.runner.kv_cache
    assert model.fused is not None, "the fused decode step was not built (it needs g++ and ninja)"
    generator = torch.Generator().manual_seed(0)
    kv.key.copy_(torch.randn(kv.key.shape, generator=generator))  # cached context of three sequences
    kv.value.copy_(torch.randn(kv.value.shape, generator=generator))
    contexts = [33, 40, 57]  # the new token included; shorter sequences are masked, as the runner does
    tables = torch.tensor([[0, 1, 2, 0], [3, 4, 5, 0], [6, 7, 8, 9]])
    slots = torch.tensor([int(tables[i, (c - 1) // 16]) * 16 + (c - 1) % 16 for i, c in enumerate(contexts)])
    mask = (torch.arange(57)[None, :] < torch.tensor(contexts)[:, None])[:, None, None, :]
    meta = AttentionMetadata(slot_mapping=slots, decode_groups=[DecodeGroup(0, 3, tables, 57, mask)])
    ids, positions = torch.tensor([1200, 7, 31000]), torch.tensor(contexts) - 1
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
