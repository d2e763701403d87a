"""The engine's dtype. ``"auto"`` picks bfloat16 where the CPU has bf16 instructions (AVX512-BF16 or
AMX-BF16) and the engine's bf16 C++ kernels are faster than its fp32 ones on this machine (measured once, kept with
the built kernels), float32 otherwise; on a CUDA GPU with native bf16, bfloat16; the choice and its reason are printed at start-up and kept on the engine, so
that every benchmark records them. float32 is the dtype that is token-exact against transformers in float32."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine import fused_layers
from engine.cpu_info import CPUINFO, cpu_flags

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo's names


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # a key of DTYPES
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]


def cpu_bf16_flags(cpuinfo: Path = CPUINFO) -> list[str]:
    """Which of BF16_CPU_FLAGS this CPU has (none where /proc/cpuinfo cannot be read)."""
    flags = cpu_flags(cpuinfo)
    return [flag for flag in BF16_CPU_FLAGS if flag in flags]


def choose_dtype(requested: str, device: str) -> DtypeChoice:
    """The dtype to run in and why; raises ValueError for an unknown name."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"invalid dtype={requested!r}: must be 'auto' or one of {', '.join(DTYPES)}")
        return DtypeChoice(requested, f"dtype {requested}: as requested")
    if torch.device(device).type == "cuda":
        return _cuda_dtype(device)
    if torch.device(device).type != "cpu":
        return DtypeChoice("float32", f"dtype auto -> float32: no bf16 rule for device {device} "
                                      "(pass dtype='bfloat16' to use it)")
    flags = cpu_bf16_flags()
    if not flags:
        return DtypeChoice("float32", "dtype auto -> float32: the CPU has no bf16 instructions "
                                      f"({' / '.join(BF16_CPU_FLAGS)})")
    kernels = fused_layers.load()
    if kernels is None:
        return DtypeChoice("float32", f"dtype auto -> float32: {', '.join(flags)} present, but the C++ kernels are "
                                      "off or could not be built (bf16 would run torch's ops)")
    speedup = fused_layers.bf16_speedup(kernels)
    measured = " / ".join(f"{value:.2f}x at {rows} row{'s' if rows != '1' else ''}" for rows, value in speedup.items())
    if min(speedup.values()) <= 1.0:
        return DtypeChoice("float32", f"dtype auto -> float32: {', '.join(flags)} present, but the bf16 C++ kernels "
                                      f"are not faster here (bf16 speed / fp32: {measured})")
    return DtypeChoice("bfloat16", f"dtype auto -> bfloat16: {', '.join(flags)} present, bf16 C++ kernels "
                                   f"({fused_layers.bf16_kernel_name(kernels)}) faster here (bf16 speed / fp32: {measured})")


def _cuda_dtype(device: str) -> DtypeChoice:
    """bf16 on a GPU that computes in it (Ampere and later: tensor cores, and half the weight and KV bytes),
    float32 on an older one (its bf16 is emulated)."""
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
        return DtypeChoice("bfloat16", f"dtype auto -> bfloat16: {device} computes in bf16")
    return DtypeChoice("float32", f"dtype auto -> float32: {device} has no native bf16 (or no CUDA device is "
                                  "visible)")
