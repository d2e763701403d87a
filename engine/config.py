"""The engine's knobs as one typed, validated, versioned config.

An update builds a whole new config and validates it before anything changes (all-or-nothing); the engine
applies it at a step boundary and every step record carries its generation. Knob names follow vLLM where
vLLM has the knob, so a tuned config carries over.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

PreemptionMode = Literal["recompute", "swap"]
SchedulingPolicy = Literal["fcfs", "priority"]
KernelBackend = Literal["auto", "torch", "cpp", "triton"]  # engine/kernel_backend.py

MAX_BLOCK_SIZE = 256


class ConfigError(ValueError):
    """A knob value that is not allowed; the message names the knob, the value and the allowed range."""

    def __init__(self, knob: str, value: Any, allowed: str) -> None:
        super().__init__(f"invalid {knob}={value!r}: {allowed}")
        self.knob = knob
        self.value = value
        self.allowed = allowed


@dataclass(frozen=True)
class ModelLimits:
    """What the config must know about the model: its context and the KV bytes one token needs."""

    max_context_len: int
    kv_bytes_per_token: int


# Knobs chosen when the engine loads: an update may repeat their value but not change it.
LOAD_TIME_KNOBS = frozenset({"kernel_backend"})
# Knobs that need the KV cache laid out anew when they change (running sequences are recomputed).
RELAYOUT_KNOBS = frozenset({"block_size", "num_kv_blocks", "kv_cache_bytes", "max_model_len", "swap_space_bytes"})


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    chunk_size: int | None = None  # None: a prefill chunk is limited only by the step budget
    prefill_token_ratio: float = 1.0
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    max_model_len: int | None = None  # None: the model's context
    preemption_mode: PreemptionMode = "recompute"
    swap_space_bytes: int = 512 << 20
    enable_prefix_caching: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    kernel_backend: KernelBackend = "auto"  # load-time: which kernels run the layer ops (engine/kernel_backend.py)
    generation: int = 0

    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "generation")

    @classmethod
    def create(cls, limits: ModelLimits, **knobs: Any) -> EngineConfig:
        _reject_unknown(knobs)
        config = cls(**knobs)
        config.validate(limits)
        return config

    def updated(self, limits: ModelLimits, **changes: Any) -> EngineConfig:
        """A validated copy with `changes` applied and the next generation number; `self` is untouched."""
        _reject_unknown(changes)
        new = dataclasses.replace(self, **changes, generation=self.generation + 1)
        new.validate(limits, changed=set(changes))
        for knob in LOAD_TIME_KNOBS & set(changes):
            if changes[knob] != getattr(self, knob):
                raise ConfigError(knob, changes[knob], f"is chosen when the engine starts (it is "
                                  f"{getattr(self, knob)!r}); restart the engine to change it")
        return new

    def knobs(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.knob_names()}

    def changed_knobs(self, other: EngineConfig) -> set[str]:
        return {name for name in self.knob_names() if getattr(self, name) != getattr(other, name)}

    # Derived sizes -----------------------------------------------------------------------------------------
    def resolved_max_model_len(self, limits: ModelLimits) -> int:
        return self.max_model_len if self.max_model_len is not None else limits.max_context_len

    def resolved_num_kv_blocks(self, limits: ModelLimits) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return self.kv_cache_bytes // (limits.kv_bytes_per_token * self.block_size)

    def num_swap_blocks(self, limits: ModelLimits) -> int:
        return self.swap_space_bytes // (limits.kv_bytes_per_token * self.block_size)

    def resolved_kernel_backend(self, device: Any, dtype: Any) -> str:
        """What `kernel_backend` means on this torch device and dtype (ConfigError when it cannot run there)."""
        from engine.kernel_backend import resolve_kernel_backend  # imports torch; the config itself does not

        return resolve_kernel_backend(self.kernel_backend, device, dtype)

    def max_prefill_tokens_per_step(self) -> int:
        return max(1, int(self.max_num_batched_tokens * self.prefill_token_ratio))

    def max_chunk(self) -> int:
        return self.chunk_size if self.chunk_size is not None else self.max_num_batched_tokens

    # Validation ----------------------------------------------------------------------------------------------
    def validate(self, limits: ModelLimits, changed: set[str] | None = None) -> None:
        """Raise ConfigError for the first bad knob. Where two knobs conflict, the error names the one that
        `changed` says the caller just set."""
        changed = changed if changed is not None else set(self.knob_names())
        _check_int(self, "max_num_seqs", low=1)
        _check_int(self, "max_num_batched_tokens", low=1)
        budget = self.max_num_batched_tokens
        if self.max_num_seqs > budget:
            if "max_num_seqs" in changed:
                raise ConfigError("max_num_seqs", self.max_num_seqs,
                                  f"must be <= max_num_batched_tokens ({budget}): each running sequence needs a "
                                  "token every step")
            raise ConfigError("max_num_batched_tokens", budget, f"must be >= max_num_seqs ({self.max_num_seqs})")
        if self.chunk_size is not None:
            _check_int(self, "chunk_size", low=1)
            if self.chunk_size > budget:
                if "chunk_size" in changed:
                    raise ConfigError("chunk_size", self.chunk_size,
                                      f"must be in 1..max_num_batched_tokens ({budget})")
                raise ConfigError("max_num_batched_tokens", budget, f"must be >= chunk_size ({self.chunk_size})")
        if isinstance(self.prefill_token_ratio, bool) or not isinstance(self.prefill_token_ratio, (int, float)):
            raise ConfigError("prefill_token_ratio", self.prefill_token_ratio, "must be a number in (0, 1]")
        if not 0.0 < self.prefill_token_ratio <= 1.0:
            raise ConfigError("prefill_token_ratio", self.prefill_token_ratio, "must be in (0, 1]")
        _check_int(self, "block_size", low=1, high=MAX_BLOCK_SIZE)
        _check_int(self, "kv_cache_bytes", low=1)
        _check_int(self, "swap_space_bytes", low=0)
        if self.max_model_len is not None:
            _check_int(self, "max_model_len", low=2, high=limits.max_context_len)
        if self.preemption_mode not in ("recompute", "swap"):
            raise ConfigError("preemption_mode", self.preemption_mode, "must be 'recompute' or 'swap'")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError("scheduling_policy", self.scheduling_policy, "must be 'fcfs' or 'priority'")
        if self.kernel_backend not in get_args(KernelBackend):
            raise ConfigError("kernel_backend", self.kernel_backend,
                              f"must be one of {', '.join(get_args(KernelBackend))}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError("enable_prefix_caching", self.enable_prefix_caching, "must be true or false")
        # The pool must hold one sequence of the longest allowed length.
        model_len = self.resolved_max_model_len(limits)
        blocks_needed = -(-model_len // self.block_size)
        if self.num_kv_blocks is not None:
            _check_int(self, "num_kv_blocks", low=1)
            if self.num_kv_blocks < blocks_needed and "num_kv_blocks" not in changed:
                knob = "max_model_len" if "max_model_len" in changed else "block_size"
                raise ConfigError(knob, getattr(self, knob),
                                  f"needs {blocks_needed} KV blocks but num_kv_blocks is {self.num_kv_blocks}")
            _check_int(self, "num_kv_blocks", low=blocks_needed)
        elif self.resolved_num_kv_blocks(limits) < blocks_needed:
            need = blocks_needed * self.block_size * limits.kv_bytes_per_token
            knob = next((k for k in ("kv_cache_bytes", "max_model_len", "block_size") if k in changed),
                        "kv_cache_bytes")
            raise ConfigError(
                knob, getattr(self, knob),
                f"needs kv_cache_bytes >= {need} (it is {self.kv_cache_bytes}) to hold one sequence of "
                f"max_model_len={model_len} tokens",
            )


def _reject_unknown(knobs: dict[str, Any]) -> None:
    unknown = sorted(set(knobs) - set(EngineConfig.knob_names()))
    if unknown:
        raise ConfigError(unknown[0], knobs[unknown[0]], f"unknown knob; known knobs: {', '.join(EngineConfig.knob_names())}")


def _check_int(config: EngineConfig, knob: str, low: int, high: int | None = None) -> None:
    value = getattr(config, knob)
    allowed = f"must be an integer in {low}..{high}" if high is not None else f"must be an integer >= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(knob, value, allowed)
    if value < low or (high is not None and value > high):
        raise ConfigError(knob, value, allowed)
