"""engine/attention.py's `paged_attention` on the Triton kernels: the same AttentionMetadata in, the same output.

`TritonBatch.from_metadata` turns the step's prefill chunks into the tensors the variable-length kernel reads (once
per step, not per layer); decode groups are used as they are (their block tables and context lengths)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.triton_kernels.decode_attention import decode_attention
from engine.triton_kernels.prefill_attention import prefill_attention


@dataclass
class TritonBatch:
    meta: AttentionMetadata
    decode_max_contexts: list[int]  # per decode group: its longest context (sizes the split-context slices)
    prefill_tables: torch.Tensor  # [chunks, blocks], padded with block 0
    prefill_starts: torch.Tensor  # [chunks] first row of each chunk in the flattened batch
    prefill_lens: torch.Tensor  # [chunks]
    prefill_contexts: torch.Tensor  # [chunks] cached tokens + the chunk
    max_prefill_len: int

    @classmethod
    def from_metadata(cls, meta: AttentionMetadata, device: torch.device) -> TritonBatch:
        chunks = meta.prefills
        width = max((c.block_table.shape[0] for c in chunks), default=0)
        tables = torch.zeros(len(chunks), max(width, 1), dtype=torch.long, device=device)
        for row, chunk in enumerate(chunks):
            tables[row, : chunk.block_table.shape[0]] = chunk.block_table
        lens = [c.end - c.start for c in chunks]
        return cls(meta=meta, decode_max_contexts=[g.context_len for g in meta.decode_groups],
                   prefill_tables=tables,
                   prefill_starts=torch.tensor([c.start for c in chunks], dtype=torch.long, device=device),
                   prefill_lens=torch.tensor(lens, dtype=torch.long, device=device),
                   prefill_contexts=torch.tensor([c.context_len for c in chunks], dtype=torch.long, device=device),
                   max_prefill_len=max(lens, default=0))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: TritonBatch,
                    scale: float) -> torch.Tensor:
    """query [tokens, heads, dim] (contiguous); key/value_cache [blocks, block_size, kv_heads, dim], the new tokens'
    keys and values already written. Returns [tokens, heads, dim]."""
    out = torch.empty_like(query)
    for group, max_context in zip(batch.meta.decode_groups, batch.decode_max_contexts):
        decode_attention(query[group.start : group.end], key_cache, value_cache, group.block_tables,
                         group.context_lens, scale, max_context, out=out[group.start : group.end])
    prefill_attention(query, key_cache, value_cache, batch.prefill_tables, batch.prefill_starts, batch.prefill_lens,
                      batch.prefill_contexts, batch.max_prefill_len, scale, out)
    return out
