"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) that runs one flattened variable-length batch over the
paged KV cache. The math mirrors Hugging Face transformers' implementation so that greedy outputs agree token for
token; q/k/v and gate/up projections are fused into one matmul each to save passes over the activations."""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from engine import fused_layers
from engine.attention import AttentionMetadata, paged_attention
from engine.kernel_backend import resolve_kernel_backend
from engine.kv_cache import KVCache
from engine.model_loader import ModelConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q + k + v outputs, hidden] (bf16 on an AMX CPU: in the tiles' layout, 4-d)
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_attention_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


class LlamaModel:
    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, kernel_backend: str = "auto") -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.kernel_backend = resolve_kernel_backend(kernel_backend, device, dtype)  # engine/kernel_backend.py
        # The C++ kernels (engine/fused_layers.py; backend "cpp") on the CPU, fp32 or bf16. With them the activations,
        # norms and biases stay fp32 and only the matrices and the KV cache take `dtype` (all sums in fp32); without
        # them everything is `dtype` and torch's ops run. `fused_loop` runs the layer loop in C++ (False: the Python
        # loop below, with the same kernels, for comparisons). The Triton kernels (engine/triton_kernels/; backend
        # "triton"): _triton_layers.
        self.kernels = fused_layers.load() if self.kernel_backend == "cpp" else None
        self.fused_loop = self.kernels is not None
        self.activation_dtype = torch.float32 if self.kernels is not None else dtype
        self.triton = importlib.import_module("engine.triton_kernels") if self.kernel_backend == "triton" else None

        def weight(name: str, matrix: bool = True) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"weight {name} is missing from the checkpoint")
            return state[name].to(device=device, dtype=dtype if matrix else self.activation_dtype).contiguous()

        self.embed_tokens = weight("model.embed_tokens.weight")
        self.final_norm = weight("model.norm.weight", matrix=False)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else weight("lm_head.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            bias = None
            if config.attention_bias:
                bias = torch.cat([weight(attn + f"{n}_proj.bias", matrix=False) for n in "qkv"])
            self.layers.append(LayerWeights(
                input_norm=weight(p + "input_layernorm.weight", matrix=False),
                qkv=torch.cat([weight(attn + f"{n}_proj.weight") for n in "qkv"]).contiguous(),
                qkv_bias=bias,
                o_proj=weight(attn + "o_proj.weight"),
                post_attention_norm=weight(p + "post_attention_layernorm.weight", matrix=False),
                gate_up=torch.cat([weight(p + "mlp.gate_proj.weight"), weight(p + "mlp.up_proj.weight")]).contiguous(),
                down=weight(p + "mlp.down_proj.weight"),
            ))
        head_dim = config.head_dim
        self.q_size = config.num_attention_heads * head_dim
        self.kv_size = config.num_key_value_heads * head_dim
        self.scale = head_dim ** -0.5
        self.inv_freq = 1.0 / (config.rope_theta ** (
            torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        if self.kernels is not None:
            self._pack_weights(self.kernels)
        # the C++ layer loop's weights and sizes, bound by name and checked once (engine/csrc/kernels.h)
        self._fused_weights = None if self.kernels is None else self.kernels.LayerWeights(
            input_norm=[layer.input_norm for layer in self.layers], qkv=[layer.qkv for layer in self.layers],
            qkv_bias=[layer.qkv_bias for layer in self.layers if layer.qkv_bias is not None],
            o_proj=[layer.o_proj for layer in self.layers],
            post_norm=[layer.post_attention_norm for layer in self.layers],
            gate_up=[layer.gate_up for layer in self.layers], down=[layer.down for layer in self.layers])
        self._fused_dims = None if self.kernels is None else self.kernels.ModelDims(
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
            eps=config.rms_norm_eps, scale=self.scale)

    def _weights_in_forward_order(self) -> list[torch.Tensor]:
        """The weights one forward pass reads, in the order it reads them (a tied embedding once, as the LM head;
        an untied one is not streamed: a step looks up a few of its rows)."""
        tensors: list[torch.Tensor] = []
        for layer in self.layers:
            tensors += [layer.input_norm, layer.qkv]
            if layer.qkv_bias is not None:
                tensors.append(layer.qkv_bias)
            tensors += [layer.o_proj, layer.post_attention_norm, layer.gate_up, layer.down]
        return tensors + [self.final_norm, self.lm_head]

    def _pack_weights(self, kernels: Any) -> None:
        """Moves the weights into one buffer in forward order on 2 MB pages (engine/csrc/pack_weights.cpp):
        a decode step streams them all, and on 4 KB pages every 4 KB of each stream is a TLB miss. bf16 matrices go
        into the packed layout first where the bf16 kernel reads it (fused_layers.packed_layout); a tied embedding
        then keeps its plain copy for the token lookups and the LM head reads the packed one."""
        tied = self.lm_head is self.embed_tokens
        tiles = functools.partial(fused_layers.packed_layout, kernels)
        self.layers = [replace(layer, qkv=tiles(layer.qkv), o_proj=tiles(layer.o_proj), gate_up=tiles(layer.gate_up),
                               down=tiles(layer.down)) for layer in self.layers]
        self.lm_head = tiles(self.lm_head)
        packed = iter(kernels.pack_weights(self._weights_in_forward_order()))
        for index, layer in enumerate(self.layers):
            self.layers[index] = LayerWeights(
                input_norm=next(packed), qkv=next(packed),
                qkv_bias=next(packed) if layer.qkv_bias is not None else None,
                o_proj=next(packed), post_attention_norm=next(packed), gate_up=next(packed), down=next(packed))
        self.final_norm, self.lm_head = next(packed), next(packed)
        if tied and self.lm_head.dim() == 2:
            self.embed_tokens = self.lm_head

    def weight_bytes(self) -> int:
        """Bytes of weights one forward pass reads (the tied embedding is read once, as the LM head)."""
        return sum(t.numel() * t.element_size() for t in self._weights_in_forward_order())

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.triton is not None:
            return self.triton.rms_norm(x, weight, self.config.rms_norm_eps)
        if x.dtype == torch.float32:
            if self.kernels is not None:  # one C++ loop instead of ~7 ATen calls
                return self.kernels.rms_norm(x, weight, self.config.rms_norm_eps)
            return F.rms_norm(x, weight.shape, weight, self.config.rms_norm_eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and a sign-folded sin: HF's rotate_half(x) * sin equals roll(x, half) * signed_sin exactly
        (negation is exact), with one op instead of four."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        return emb.cos().to(self.activation_dtype)[:, None, :], sin.to(self.activation_dtype)[:, None, :]

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        """input_ids, positions: [tokens]. Returns the final hidden states [tokens, hidden] (before the norm)."""
        cfg = self.config
        num_tokens = input_ids.shape[0]
        num_qk_heads = cfg.num_attention_heads + cfg.num_key_value_heads
        hidden = F.embedding(input_ids, self.embed_tokens).to(self.activation_dtype)
        cos, sin = self._rope(positions)
        if self.triton is not None:
            return self._triton_layers(hidden, cos, sin, meta, kv_cache)
        if self.fused_loop and self.kernels is not None:
            groups, chunks = meta.decode_groups, meta.prefills
            plan = self.kernels.StepPlan(
                decode_start=[g.start for g in groups], decode_end=[g.end for g in groups],
                decode_tables=[g.block_tables for g in groups], decode_context_lens=[g.context_lens for g in groups],
                prefill_start=[c.start for c in chunks], prefill_end=[c.end for c in chunks],
                prefill_context=[c.context_len for c in chunks], prefill_tables=[c.block_table for c in chunks],
                prefill_masks=[c.mask for c in chunks])
            return self.kernels.decoder_layers(  # the loop below, in C++, bit for bit
                hidden, cos, sin, meta.slot_mapping, plan, self._fused_weights, kv_cache.key, kv_cache.value,
                self._fused_dims)
        kernels = self.kernels
        for index, layer in enumerate(self.layers):
            x = self._rms_norm(hidden, layer.input_norm)
            qkv = self._linear(x, layer.qkv, layer.qkv_bias)
            if kernels is not None:  # rotary and the cache write in one C++ pass
                q, k, v = kernels.rotary_cache_write(qkv, cos, sin, meta.slot_mapping, kv_cache.key[index],
                                                     kv_cache.value[index], cfg.num_attention_heads,
                                                     cfg.num_key_value_heads, cfg.head_dim)
            else:
                qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
                # Rotate queries and keys in one pass: they share positions.
                qk = self._apply_rope(qk.view(num_tokens, num_qk_heads, cfg.head_dim), cos, sin)
                q, k = qk.split([cfg.num_attention_heads, cfg.num_key_value_heads], dim=1)
                v = v.view(num_tokens, cfg.num_key_value_heads, cfg.head_dim)
                kv_cache.write(index, meta.slot_mapping, k, v)
            attn = paged_attention(q, k, v, kv_cache.key[index], kv_cache.value[index], meta, self.scale, kernels)
            hidden = self._linear(attn.view(num_tokens, self.q_size), layer.o_proj, residual=hidden)
            x = self._rms_norm(hidden, layer.post_attention_norm)
            gate_up = self._linear(x, layer.gate_up)
            if kernels is not None:
                activated = kernels.silu_and_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                activated = F.silu(gate) * up
            hidden = self._linear(activated, layer.down, residual=hidden)
        return hidden

    def _triton_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                       kv_cache: KVCache, batch: Any | None = None) -> torch.Tensor:
        """The layer loop of forward() on the Triton kernels: the residual add happens inside the next RMS norm
        (same roundings as residual + x, then the norm); the matmuls are torch's (cuBLAS on a GPU). `batch`: the
        kernels' view of `meta` (engine/triton_kernels/paged_attention.py), given by a captured CUDA graph."""
        ops, cfg, eps = self.triton, self.config, self.config.rms_norm_eps
        assert ops is not None
        if batch is None:
            batch = ops.TritonBatch.from_metadata(meta, self.device)  # once per step, not per layer
        residual = hidden
        x = ops.rms_norm(hidden, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            key_cache, value_cache = kv_cache.key[index], kv_cache.value[index]
            q = ops.rotary_cache_write(F.linear(x, layer.qkv, layer.qkv_bias), cos, sin, meta.slot_mapping,
                                       key_cache, value_cache, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.head_dim)
            attn = ops.paged_attention(q, key_cache, value_cache, batch, self.scale)
            x = ops.rms_norm(F.linear(attn.view(-1, self.q_size), layer.o_proj), layer.post_attention_norm, eps,
                             residual=residual)
            down = F.linear(ops.silu_and_mul(F.linear(x, layer.gate_up)), layer.down)
            if index + 1 < len(self.layers):
                x = ops.rms_norm(down, self.layers[index + 1].input_norm, eps, residual=residual)
            else:
                residual += down
        return residual

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._linear(self._rms_norm(hidden, self.final_norm), self.lm_head).float()

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + F.linear(x, weight, bias); with the C++ kernels (engine/fused_layers.py), which add the residual
        in the same pass and take a weight in the AMX tiles' layout."""
        if self.kernels is not None:
            return self.kernels.linear(x, weight, bias, residual)
        out = F.linear(x, weight, bias)
        return out if residual is None else residual + out
