"""What this CPU is, from /proc/cpuinfo (its first core's lines; the others repeat them): its model name and its
instruction-set flags. Torch-free, so the benchmarks and the dtype choice read it alike."""

from __future__ import annotations

import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def _field(key: str, cpuinfo: Path) -> str | None:
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), None)


def cpu_name(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name ("Intel(R) Xeon(R) Processor"); platform.processor() where /proc/cpuinfo has none."""
    return _field("model name", cpuinfo) or platform.processor() or "unknown"


def cpu_flags(cpuinfo: Path = CPUINFO) -> list[str]:
    """The CPU's instruction-set flags as /proc/cpuinfo names them ("avx512_bf16", "amx_tile"); none where it
    cannot be read."""
    return (_field("flags", cpuinfo) or "").split()
