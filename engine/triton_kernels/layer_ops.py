"""The decoder's element-wise ops in Triton, each one pass over its rows instead of several torch ops: RMS norm
(optionally adding the residual first, in the same pass), rotary embedding of queries and keys together with the
write of the new keys and values into the paged cache, and SiLU(gate) * up.

Each rounds where transformers' bf16 / fp16 code rounds (the residual sum, the normalized activations before the
weight, each rotary product, the SiLU before the product), so low-precision outputs follow the reference's; in fp32
every rounding is the identity. Several rows share one program under the interpreter (which runs programs one after
another); one row per program on a GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rows_per_program(device: torch.device) -> int:
    return 1 if device.type == "cuda" else 32


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, num_rows, eps, stride_x, stride_r, stride_o,
                     HIDDEN: tl.constexpr, HIDDEN_PAD: tl.constexpr, ROWS: tl.constexpr,
                     ADD_RESIDUAL: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, HIDDEN_PAD)
    rows64 = rows.to(tl.int64)
    mask = (rows < num_rows)[:, None] & (cols < HIDDEN)[None, :]
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if ADD_RESIDUAL:  # residual += x, rounded to the activations' dtype, and the norm of the sum
        summed = (x + tl.load(residual_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask,
                              other=0.0).to(tl.float32)).to(dtype)
        tl.store(residual_ptr + rows64[:, None] * stride_r + cols[None, :], summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=1) / HIDDEN
    normed = (x * tl.math.rsqrt(variance + eps)[:, None]).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], (normed * weight[None, :]).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor:
    """weight * norm(x) for x [rows, hidden]; with `residual`: residual += x (in place) and the norm of the sum."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    if rows == 0:
        return out
    block = rows_per_program(x.device)
    res = residual if residual is not None else x
    _rms_norm_kernel[(triton.cdiv(rows, block),)](
        x, res, weight, out, rows, eps, x.stride(0), res.stride(0), out.stride(0), HIDDEN=hidden,
        HIDDEN_PAD=triton.next_power_of_2(hidden), ROWS=block, ADD_RESIDUAL=residual is not None)
    return out


@triton.jit
def _rotary_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, num_tokens,
                         stride_qkv, stride_cos, stride_sin, stride_q_tok, stride_cache_slot,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                         KV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, ROWS: tl.constexpr):
    tokens = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    tok64 = tokens.to(tl.int64)
    t_mask = tokens < num_tokens
    d = tl.arange(0, DIM_PAD)
    d_mask = d < HEAD_DIM
    half = HEAD_DIM // 2
    rolled = tl.where(d < half, d + half, d - half)  # roll by half: HF's rotate_half up to the sign in `sin`
    cos = tl.load(cos_ptr + tok64[:, None] * stride_cos + d[None, :], mask=t_mask[:, None] & d_mask[None, :],
                  other=0.0).to(tl.float32)[:, None, :]
    sin = tl.load(sin_ptr + tok64[:, None] * stride_sin + d[None, :], mask=t_mask[:, None] & d_mask[None, :],
                  other=0.0).to(tl.float32)[:, None, :]
    h = tl.arange(0, HEADS_PAD)  # query and key heads together: they share positions
    mask = t_mask[:, None, None] & (h < NUM_HEADS + NUM_KV_HEADS)[None, :, None] & d_mask[None, None, :]
    base = qkv_ptr + tok64[:, None, None] * stride_qkv + h[None, :, None] * HEAD_DIM
    x = tl.load(base + d[None, None, :], mask=mask, other=0.0)
    dtype = x.dtype
    x_rolled = tl.load(base + rolled[None, None, :], mask=mask, other=0.0).to(tl.float32)
    rotated = ((x.to(tl.float32) * cos).to(dtype).to(tl.float32) + (x_rolled * sin).to(dtype).to(tl.float32))
    rotated = rotated.to(dtype)
    is_q = (h < NUM_HEADS)[None, :, None]
    tl.store(q_out_ptr + tok64[:, None, None] * stride_q_tok + h[None, :, None] * HEAD_DIM + d[None, None, :],
             rotated, mask=mask & is_q)
    slots = tl.load(slots_ptr + tokens, mask=t_mask, other=-1).to(tl.int64)  # -1: a padded row, not written
    write = (slots >= 0)[:, None, None]
    kv_h = h - NUM_HEADS
    tl.store(k_cache_ptr + slots[:, None, None] * stride_cache_slot + kv_h[None, :, None] * HEAD_DIM
             + d[None, None, :], rotated, mask=mask & write & (h >= NUM_HEADS)[None, :, None])
    v_h = tl.arange(0, KV_PAD)
    v_mask = t_mask[:, None, None] & (v_h < NUM_KV_HEADS)[None, :, None] & d_mask[None, None, :] & write
    v = tl.load(qkv_ptr + tok64[:, None, None] * stride_qkv + (NUM_HEADS + NUM_KV_HEADS + v_h)[None, :, None]
                * HEAD_DIM + d[None, None, :], mask=v_mask, other=0.0)
    tl.store(v_cache_ptr + slots[:, None, None] * stride_cache_slot + v_h[None, :, None] * HEAD_DIM
             + d[None, None, :], v, mask=v_mask)


def rotary_cache_write(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, slot_mapping: torch.Tensor,
                       key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                       head_dim: int) -> torch.Tensor:
    """qkv [tokens, (heads + 2 kv_heads) * dim]; cos / signed_sin [tokens, 1 or nothing, dim] (engine/model.py's
    tables); key/value_cache [blocks, block_size, kv_heads, dim] (contiguous). Rotates queries and keys, writes the
    keys and values at their slots (slot -1: not written) and returns the rotated queries [tokens, heads, dim]."""
    tokens = qkv.shape[0]
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    if not (key_cache.is_contiguous() and value_cache.is_contiguous() and qkv.stride(-1) == 1):
        raise ValueError("rotary_cache_write needs contiguous caches and qkv rows")
    cos2, sin2 = cos.reshape(tokens, head_dim), signed_sin.reshape(tokens, head_dim)
    block = rows_per_program(qkv.device)
    _rotary_cache_kernel[(triton.cdiv(tokens, block),)](
        qkv, cos2, sin2, slot_mapping, q, key_cache, value_cache, tokens, qkv.stride(0), cos2.stride(0),
        sin2.stride(0), q.stride(0), num_kv_heads * head_dim, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads + num_kv_heads), KV_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), ROWS=block)
    return q


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, num_rows, stride_in, stride_out, WIDTH: tl.constexpr,
                         BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < WIDTH)[None, :]
    gate = tl.load(gate_up_ptr + rows[:, None] * stride_in + cols[None, :], mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + rows[:, None] * stride_in + WIDTH + cols[None, :], mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], (silu * up.to(tl.float32)).to(gate.dtype),
             mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * width] (gate, then up) -> silu(gate) * up [rows, width]."""
    rows, double = gate_up.shape
    width = double // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = 1024 if gate_up.device.type == "cuda" else triton.next_power_of_2(width)
    row_block = rows_per_program(gate_up.device)
    _silu_and_mul_kernel[(triton.cdiv(rows, row_block), triton.cdiv(width, block))](
        gate_up, out, rows, gate_up.stride(0), out.stride(0), WIDTH=width, BLOCK=block, ROWS=row_block)
    return out
