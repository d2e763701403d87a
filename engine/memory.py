"""How much memory a re-laid-out KV cache may take: a live update that would exhaust the machine is refused
(ConfigError naming the knob) instead of failing the allocation half-way."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError, EngineConfig, ModelLimits

FREE_MEMORY_SHARE = 0.5  # without an explicit cap, a new pool may take this share of the memory free now


def available_memory_bytes(device: str) -> int | None:
    """Memory free for a new KV pool on `device` (None if unknown)."""
    try:
        if device.startswith("cuda"):
            import torch

            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except Exception:  # an unknown amount means no automatic cap
        return None
    return None


@dataclass(frozen=True)
class KVMemoryGuard:
    """The cap on the KV pools (device, and host swap space) of a live re-layout."""

    device: str
    max_bytes: int | None = None  # None: a share of the memory free when the update comes

    def cap(self) -> int | None:
        if self.max_bytes is not None:
            return self.max_bytes
        free = available_memory_bytes(self.device)
        return None if free is None else int(free * FREE_MEMORY_SHARE)

    def check(self, candidate: EngineConfig, knobs: Mapping[str, Any], limits: ModelLimits) -> None:
        """Raise ConfigError, naming the knob that `knobs` set (or the one that sizes the pool), when the pools of
        `candidate` would not fit under the cap."""
        cap = self.cap()
        if cap is None:
            return
        per_block = limits.kv_bytes_per_token * candidate.block_size  # keys and values
        device_bytes = candidate.resolved_num_kv_blocks(limits) * per_block
        host_bytes = candidate.num_swap_blocks(limits) * per_block
        on_cpu = self.device == "cpu"
        total = device_bytes + (host_bytes if on_cpu else 0)
        if total <= cap and (on_cpu or host_bytes <= cap):
            return
        if candidate.num_kv_blocks is not None:
            knob = "num_kv_blocks"
        elif "kv_cache_bytes" in knobs or "block_size" not in knobs:
            knob = "kv_cache_bytes"
        else:
            knob = "block_size"
        if host_bytes > device_bytes and "swap_space_bytes" in knobs:
            knob = "swap_space_bytes"
        raise ConfigError(knob, knobs.get(knob, getattr(candidate, knob)),
                          f"the KV pools would take {total} bytes; this server allows at most {cap} "
                          "(see --max-kv-memory-bytes)")
