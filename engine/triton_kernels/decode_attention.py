"""Paged decode attention in Triton: one new query token per sequence against its keys and values, read straight
from the paged KV cache through the block table.

One program handles the query heads that share one KV head (grouped-query attention reads each key and value row
once for the whole group) over one slice of the context. With one slice the program writes the normalized output;
with several (the split-context path, for long contexts at small batches, where sequences x KV heads would leave
most of a GPU idle) each slice writes its unnormalized partial output, running max and sum of exponentials, and a
second kernel merges them. Tokens map to cache slots one by one (block = token // block_size), so every block size
works, and a context may end anywhere inside its last block. A sequence with context 0 (a padded row of a
captured CUDA graph) gets a zero output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per tile of the context walk (independent of the cache's block_size): on a GPU, and under the interpreter
# (whose cost is per operation, not per element, so fewer, larger tiles run faster).
BLOCK_N = 32
INTERPRETER_BLOCK_N = 128
# A slice is never shorter than this many tokens: below it the merge costs more than the parallelism gains.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 16


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
                   part_acc_ptr, part_m_ptr, part_l_ptr, scale, tokens_per_split,
                   stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
                   stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
                   stride_table, num_splits,
                   BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(context_lens_ptr + seq).to(tl.int32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    for tile in range(start, end, BLOCK_N):
        t = tile + tl.arange(0, BLOCK_N)
        t_mask = t < end
        block = tl.load(table + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot = (t % BLOCK_SIZE).to(tl.int64)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_k_block + slot[:, None] * stride_k_slot
                    + kv_head * stride_k_head + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK_N]
        scores = tl.where(t_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: every tile walked has a token
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + block[:, None] * stride_v_block + slot[:, None] * stride_v_slot
                    + kv_head * stride_v_head + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        part = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [seqs, heads, splits]
        tl.store(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=out_mask)
        tl.store(part_m_ptr + part, m, mask=g_mask)
        tl.store(part_l_ptr + part, row_sum, mask=g_mask)
    else:
        o = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, num_splits, stride_o_tok, stride_o_head,
                  HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    s_mask = s < num_splits
    part = (seq * tl.num_programs(1) + head) * num_splits + s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    row_sum = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # context 0: every slice empty
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    total = tl.sum(row_sum * weight, axis=0)
    o = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_o_tok + head * stride_o_head + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Slices per context: enough programs for about two per streaming multiprocessor on a GPU, none shorter than
    MIN_TOKENS_PER_SPLIT; 1 under the interpreter (which runs programs one after another)."""
    if device.type != "cuda":
        return 1
    programs_wanted = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    by_occupancy = -(-programs_wanted // max(1, num_seqs * num_kv_heads))
    by_length = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, max_context: int,
                     num_splits: int | None = None, out: torch.Tensor | None = None,
                     block_n: int | None = None) -> torch.Tensor:
    """query [seqs, heads, dim]; key/value_cache [blocks, block_size, kv_heads, dim] (one layer's); block_tables
    [seqs, blocks] (padded with any valid block id); context_lens [seqs] (the new token included); max_context: a
    bound on context_lens (host int: it sizes the slices); num_splits and block_n (tokens per tile) override the
    device's choice. Returns [seqs, heads, dim] (into `out` if given)."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query) if out is None else out
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, query.device)
    if block_n is None:
        block_n = BLOCK_N if query.device.type == "cuda" else INTERPRETER_BLOCK_N
    per_split = -(-max(1, max_context) // num_splits)
    per_split = -(-per_split // block_n) * block_n
    dim_pad = triton.next_power_of_2(head_dim)
    split = num_splits > 1
    if split:
        part_acc = torch.empty(num_seqs, num_heads, num_splits, dim_pad, dtype=torch.float32, device=query.device)
        part_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, context_lens, out, part_acc, part_m, part_l, scale, per_split,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0), num_splits,
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        DIM_PAD=dim_pad, BLOCK_N=block_n, SPLIT=split)
    if split:
        _merge_kernel[(num_seqs, num_heads)](part_acc, part_m, part_l, out, num_splits, out.stride(0),
                                             out.stride(1), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
                                             SPLITS_PAD=triton.next_power_of_2(num_splits))
    return out
