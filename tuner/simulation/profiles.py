"""The step-time profiles shipped with the default engine, which one a machine takes, and the model limits a
simulation takes from a profile or from a live engine's admin config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engine.config import ModelLimits
from engine.cpu_info import cpu_name
from tuner.simulation.simulator import DEFAULT_LIMITS
from tuner.simulation.step_time_model import StepTimeModel

DEFAULT_PROFILE = Path(__file__).with_name("default_profile.json")  # the default engine in float32
# The shipped profiles of the default engine: per dtype it runs in (`dtype="auto"` picks one per machine), per CPU
# model they were calibrated on (as /proc/cpuinfo names it; a step's shape moves with the CPU: matrix units against
# memory bandwidth). The first of a dtype serves any other CPU; tune rescales each to the engine's own steps.
SHIPPED_PROFILES: dict[str, dict[str, Path]] = {
    "float32": {"AMD EPYC": DEFAULT_PROFILE},
    "bfloat16": {"Intel(R) Xeon(R) Processor": Path(__file__).with_name("default_profile_bfloat16.json"),
                 "AMD EPYC": Path(__file__).with_name("default_profile_bfloat16_amd_epyc.json")},
}


def profile_path(given: str | None, dtype: str | None = None, cpu: str | None = None) -> Path:
    """--profile, else $SLOTUNE_PROFILE, else the profile shipped for the default engine in ``dtype`` (the engine's,
    when known) calibrated on ``cpu`` (default: this machine's), else the first of that dtype, else float32's."""
    if given or os.environ.get("SLOTUNE_PROFILE"):
        return Path(given or os.environ["SLOTUNE_PROFILE"])
    of_dtype = SHIPPED_PROFILES.get(dtype or "", SHIPPED_PROFILES["float32"])
    return of_dtype.get(cpu or cpu_name(), next(iter(of_dtype.values())))


def limits_of(model: StepTimeModel, admin_config: dict[str, Any] | None = None) -> ModelLimits:
    """The model limits of the engine whose GET /admin/config answer is ``admin_config``, else those the step-time
    profile was measured with (the simulator's defaults where it does not say)."""
    lim = limits_from(admin_config) if admin_config else model.meta.get("limits") or {}
    return ModelLimits(max_context_len=int(lim.get("max_context_len", DEFAULT_LIMITS.max_context_len)),
                       kv_bytes_per_token=int(lim.get("kv_bytes_per_token", DEFAULT_LIMITS.kv_bytes_per_token)))


def limits_from(admin_config: dict[str, Any]) -> dict[str, int]:
    """The model's context and KV bytes per token from GET /admin/config's knobs and resolved sizes. The pool size
    only brackets the bytes per token (num_kv_blocks = kv_cache_bytes // (bytes_per_token * block_size)); within
    the bracket the value with the most factors of two is taken (2 x layers x KV heads x head dim x element size
    is rich in them), which recovers the exact value for the usual model shapes."""
    knobs, resolved = admin_config.get("config", {}), admin_config.get("resolved") or {}
    size, bs, n = int(knobs.get("kv_cache_bytes") or 0), int(knobs.get("block_size") or 1), \
        int(resolved.get("num_kv_blocks") or 0)
    kv_per_token = DEFAULT_LIMITS.kv_bytes_per_token
    if size and n and knobs.get("num_kv_blocks") is None:
        lo, hi = size // ((n + 1) * bs) + 1, size // (n * bs)  # every k in lo..hi gives n blocks
        candidates = [k for k in range(lo, hi + 1) if size // (k * bs) == n] or [hi]
        kv_per_token = max(candidates, key=lambda k: ((k & -k), k))
    max_len = resolved.get("max_model_len") if knobs.get("max_model_len") is None else None
    return {"max_context_len": int(max_len or DEFAULT_LIMITS.max_context_len), "kv_bytes_per_token": kv_per_token}
