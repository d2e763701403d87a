"""Torch attention over the paged KV cache for one flattened variable-length batch.

The batch is laid out decodes first, then prefill chunks. Decode tokens are grouped by context length; with the C++
kernels (engine/fused_layers.py: fp32 queries, fp32 or bf16 caches) a group's queries read their keys and values in
place through the block tables, otherwise the group gathers them once, padded only to its longest context. Each
prefill chunk attends to its sequence's cached context plus itself with a causal mask, in the cache's dtype: with the
C++ kernels, a bf16 cache and AVX512-BF16, in the kernels' own flash attention reading the cache in place
(csrc/prefill_attention.cpp); otherwise in torch's scaled_dot_product_attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class DecodeGroup:
    start: int  # first token (= first decode sequence) of the group in the flattened batch
    end: int
    block_tables: torch.Tensor  # [seqs, blocks], padded with block 0
    context_len: int  # the group's longest context; shorter ones are masked
    mask: torch.Tensor | None  # [seqs, 1, 1, context_len] True where attended; None when all contexts are equal
    context_lens: torch.Tensor  # [seqs] each sequence's context, the new token included


@dataclass
class PrefillChunk:
    start: int
    end: int
    context_len: int  # tokens attended after this chunk: cached context + the chunk itself
    block_table: torch.Tensor  # [blocks] of the sequence, enough for context_len
    mask: torch.Tensor | None  # [chunk, context_len] causal mask shifted by the cached context; None if none cached


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] flat KV slot of every new token
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    kernels: Any | None = None) -> torch.Tensor:
    """query [tokens, heads, dim]; key/value [tokens, kv_heads, dim] (already written to the cache);
    key_cache/value_cache [blocks, block_size, kv_heads, dim]; kernels: engine/fused_layers.py's module or None.
    Returns [tokens, heads, dim]."""
    if len(meta.decode_groups) == 1 and not meta.prefills:  # pure decode of one group: no copy into `out`
        return _decode_group(query, key_cache, value_cache, meta.decode_groups[0], scale, kernels)
    out = torch.empty_like(query)
    for group in meta.decode_groups:
        out[group.start : group.end] = _decode_group(query, key_cache, value_cache, group, scale, kernels)
    prefill_kernels = (kernels if kernels is not None and key_cache.dtype == torch.bfloat16
                       and query.dtype == torch.float32 and kernels.bf16_dot_supported() else None)
    for chunk in meta.prefills:
        if prefill_kernels is not None:  # the C++ kernel: the context, the chunk's own keys included, from the cache
            out[chunk.start : chunk.end] = prefill_kernels.prefill_attention(
                query[chunk.start : chunk.end], key_cache, value_cache, chunk.block_table, chunk.context_len, scale)
            continue
        # In the cache's dtype: a bf16 cache beside fp32 activations runs the chunk's attention in bf16 (torch's bf16
        # flash attention, ~2.5x its fp32 one on a CPU with bf16 instructions), on the keys and values as cached.
        q = query[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0).to(key_cache.dtype)  # [1, heads, chunk, dim]
        if chunk.mask is None:  # nothing cached before the chunk: attend to the chunk's own keys
            k = key[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0).to(key_cache.dtype)
            v = value[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0).to(key_cache.dtype)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            k = _gather(key_cache, chunk.block_table.unsqueeze(0))[..., : chunk.context_len, :]
            v = _gather(value_cache, chunk.block_table.unsqueeze(0))[..., : chunk.context_len, :]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
        out[chunk.start : chunk.end] = o.squeeze(0).transpose(0, 1)  # (widened back to the query's dtype)
    return out


def _decode_group(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: DecodeGroup,
                  scale: float, kernels: Any | None) -> torch.Tensor:
    if kernels is not None and query.dtype == torch.float32:  # fp32 or bf16 caches
        return kernels.decode_attention(query[group.start : group.end], key_cache, value_cache, group.block_tables,
                                        group.context_lens, scale)
    k = _gather(key_cache, group.block_tables)[..., : group.context_len, :]  # [seqs, kv_heads, ctx, dim]
    v = _gather(value_cache, group.block_tables)[..., : group.context_len, :]
    q = query[group.start : group.end].unsqueeze(2)  # [seqs, heads, 1, dim]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[seqs, blocks] block ids -> [seqs, kv_heads, blocks * block_size, dim]."""
    seqs, n = block_tables.shape
    _, bs, heads, dim = cache.shape
    # index_select on the flattened table is several times faster than advanced indexing cache[block_tables].
    blocks = cache.index_select(0, block_tables.reshape(-1))  # [seqs * blocks, block_size, kv_heads, dim]
    return blocks.view(seqs, n * bs, heads, dim).transpose(1, 2)
