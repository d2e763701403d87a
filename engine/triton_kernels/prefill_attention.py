"""Variable-length prefill attention in Triton for chunked prefill: several sequences' chunks in one launch, each
chunk's queries attending to the earlier chunks of the same sequence in the paged cache and causally to themselves.

The chunk's own keys and values are already in the cache (the rotary kernel writes them first), so every key is
read through the block table, whatever chunk it came from: query i of a chunk that starts after `cached` tokens
sees keys 0 .. cached + i. One program handles one tile of one chunk's queries for one head (flash attention's
online softmax over tiles of keys)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (queries, keys) per tile, on a GPU and under the interpreter (whose cost is per operation, not per element);
# tl.dot needs at least 16 of each.
TILES = (16, 32)
INTERPRETER_TILES = (64, 64)


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, q_starts_ptr, q_lens_ptr,
                    context_lens_ptr, scale, stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
                    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
                    stride_table,
                    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + chunk).to(tl.int32)
    if tile * BLOCK_M < q_len:
        q_start = tl.load(q_starts_ptr + chunk).to(tl.int64)
        cached = tl.load(context_lens_ptr + chunk).to(tl.int32) - q_len
        kv_head = head // GROUP
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        r_mask = rows < q_len
        d = tl.arange(0, DIM_PAD)
        d_mask = d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
                    mask=r_mask[:, None] & d_mask[None, :], other=0.0)
        positions = cached + rows  # of the queries in the sequence
        keys_end = cached + tl.minimum(tile * BLOCK_M + BLOCK_M, q_len)  # keys this tile can see
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        table = block_tables_ptr + chunk.to(tl.int64) * stride_table
        for key_tile in range(0, keys_end, BLOCK_N):
            t = key_tile + tl.arange(0, BLOCK_N)
            t_mask = t < keys_end
            block = tl.load(table + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
            slot = (t % BLOCK_SIZE).to(tl.int64)
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + block[:, None] * stride_k_block + slot[:, None] * stride_k_slot
                        + kv_head * stride_k_head + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:  # fp32: no TF32 rounding on tensor cores
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            visible = (t[None, :] <= positions[:, None]) & t_mask[None, :]
            scores = tl.where(visible, scores * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: key 0 is in the first tile for every row
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            row_sum = row_sum * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + block[:, None] * stride_v_block + slot[:, None] * stride_v_slot
                        + kv_head * stride_v_head + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        o = acc / row_sum[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_o_tok + head * stride_o_head + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                      context_lens: torch.Tensor, max_q_len: int, scale: float, out: torch.Tensor,
                      tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """query/out [tokens, heads, dim] (the whole flattened batch; chunk c owns rows q_starts[c] ..
    q_starts[c] + q_lens[c]); key/value_cache [blocks, block_size, kv_heads, dim]; block_tables [chunks, blocks];
    context_lens [chunks]: tokens of the sequence after the chunk (cached + the chunk); tiles: (queries, keys) per
    tile instead of the device's. Writes the chunks' rows of `out` and returns it."""
    num_chunks = q_lens.shape[0]
    if num_chunks == 0 or max_q_len == 0:
        return out
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    block_m, block_n = tiles or (TILES if query.device.type == "cuda" else INTERPRETER_TILES)
    grid = (num_chunks, triton.cdiv(max_q_len, block_m), num_heads)
    _prefill_kernel[grid](
        query, key_cache, value_cache, out, block_tables, q_starts, q_lens, context_lens, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=query.dtype == torch.float32)
    return out
