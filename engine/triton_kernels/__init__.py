"""The engine's Triton kernels (the `triton` kernel backend, engine/kernel_backend.py): paged decode attention with a
split-context path (decode_attention.py), variable-length prefill attention over the paged cache
(prefill_attention.py), RMS norm with the residual add, rotary embedding with the KV-cache write, and SiLU * up
(layer_ops.py); paged_attention.py runs a step's attention on them from engine/attention.py's metadata.

They run on a CUDA GPU, and on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before triton is first
imported) in fp32 and fp16 only: the interpreter computes bf16 `tl.dot` wrongly."""

from engine.triton_kernels import decode_attention as _decode_module
from engine.triton_kernels.decode_attention import decode_attention
from engine.triton_kernels.layer_ops import rms_norm, rotary_cache_write, silu_and_mul
from engine.triton_kernels.paged_attention import TritonBatch, paged_attention
from engine.triton_kernels.prefill_attention import prefill_attention


def interpreted() -> bool:
    """Whether the kernels were decorated for Triton's interpreter (TRITON_INTERPRET=1 when first imported)."""
    return type(_decode_module._decode_kernel).__name__ == "InterpretedFunction"


__all__ = ["interpreted", "TritonBatch", "decode_attention", "paged_attention", "prefill_attention", "rms_norm",
           "rotary_cache_write", "silu_and_mul"]
