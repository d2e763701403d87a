"""Which kernels run the model's layer ops (the `kernel_backend` knob, chosen when the engine loads):

- ``torch``: the Python layer loop on torch's ops (any device, any dtype);
- ``cpp``: the C++ kernels and layer loop of engine/fused_layers.py (CPU, fp32 or bf16; built with g++ on first use);
- ``triton``: the Triton kernels of engine/triton_kernels/ (CUDA GPUs; on the CPU only under Triton's interpreter,
  TRITON_INTERPRET=1 set before triton is imported, in fp32 or fp16, for tests);
- ``auto``: triton on a CUDA device, cpp on the CPU (fp32, bf16) when the C++ kernels build, torch otherwise.

All three run the same model code (engine/model.py) on the same flattened batch, so steps and step records have the
same structure whatever the backend."""

from __future__ import annotations

import importlib.util
import os
from typing import get_args

import torch

from engine.config import ConfigError, KernelBackend

KERNEL_BACKENDS: tuple[str, ...] = get_args(KernelBackend)
INTERPRETER_DTYPES = (torch.float32, torch.float16)


def resolve_kernel_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend `requested` means on this device and dtype; ConfigError (naming the knob) when it cannot run."""
    if requested not in KERNEL_BACKENDS:
        raise ConfigError("kernel_backend", requested, f"must be one of {', '.join(KERNEL_BACKENDS)}")
    if requested == "auto":
        if device.type == "cuda" and triton_unavailable_reason(device, dtype) is None:
            return "triton"
        if cpp_unavailable_reason(device, dtype) is None:
            return "cpp"
        return "torch"
    reason = {"cpp": cpp_unavailable_reason, "triton": triton_unavailable_reason}.get(requested)
    problem = reason(device, dtype) if reason is not None else None
    if problem is not None:
        raise ConfigError("kernel_backend", requested, problem)
    return requested


def cpp_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    from engine import fused_layers

    if device.type != "cpu" or dtype not in fused_layers.KERNEL_DTYPES:
        return f"the C++ kernels run on the CPU in float32 or bfloat16 only (device {device}, {dtype})"
    if not fused_layers.enabled():
        return f"the C++ kernels are turned off ({fused_layers.ENV_SWITCH}=0)"
    if fused_layers.load() is None:
        return "the C++ kernels could not be built (see the warning above)"
    return None


def triton_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "CUDA is not available"
    if device.type != "cpu":
        return f"the Triton kernels run on CUDA GPUs (device {device})"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "on the CPU the Triton kernels run only under the interpreter: set TRITON_INTERPRET=1 before start"
    if dtype not in INTERPRETER_DTYPES:
        return f"Triton's interpreter computes {dtype} dot products wrongly; use float32 or float16 on the CPU"
    from engine import triton_kernels

    if not triton_kernels.interpreted():
        return "engine.triton_kernels was imported before TRITON_INTERPRET=1 was set: its kernels are compiled ones"
    return None
