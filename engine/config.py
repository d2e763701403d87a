"""The engine's knobs as one typed, validated, versioned config.

An update builds a whole new config and validates it before anything changes (all-or-nothing); the engine
applies it at a step boundary and every step record carries its generation. Knob names follow vLLM where
vLLM has the knob, so a tuned config carries over.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from engine.knobs import KNOB_BY_NAME, KNOB_NAMES, LOAD_TIME_KNOBS, RELAYOUT_KNOBS

# The three name knobs' choices as types, for the type checker; the knob schema's `choices` are the values, and
# tests/test_config.py holds the two to each other.
PreemptionMode = Literal["recompute", "swap"]
SchedulingPolicy = Literal["fcfs", "priority"]
KernelBackend = Literal["auto", "torch", "cpp", "triton"]  # engine/kernel_backend.py resolves auto

__all__ = ["RELAYOUT_KNOBS", "ConfigError", "EngineConfig", "ModelLimits", "PreemptionMode", "SchedulingPolicy"]


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


def _default(name: str) -> Any:
    return KNOB_BY_NAME[name].default


@dataclass(frozen=True)
class EngineConfig:
    """Every knob (engine.knobs describes each) and the generation number of this config."""

    max_num_seqs: int = _default("max_num_seqs")
    max_num_batched_tokens: int = _default("max_num_batched_tokens")
    chunk_size: int | None = _default("chunk_size")
    prefill_token_ratio: float = _default("prefill_token_ratio")
    block_size: int = _default("block_size")
    num_kv_blocks: int | None = _default("num_kv_blocks")
    kv_cache_bytes: int = _default("kv_cache_bytes")
    max_model_len: int | None = _default("max_model_len")
    preemption_mode: PreemptionMode = _default("preemption_mode")
    swap_space_bytes: int = _default("swap_space_bytes")
    enable_prefix_caching: bool = _default("enable_prefix_caching")
    scheduling_policy: SchedulingPolicy = _default("scheduling_policy")
    kernel_backend: KernelBackend = _default("kernel_backend")  # load-time (engine/kernel_backend.py)
    generation: int = 0

    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        return KNOB_NAMES

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
        """Raise ConfigError for the first bad knob. Each check covers a knob's type and its range together (a JSON
        5.0, "64", true or null where an integer belongs fails like 0 does, with the allowed range), so this is the
        one validation of a knob value. Where two knobs conflict, the error names the one that `changed` says the
        caller just set."""
        changed = changed if changed is not None else set(self.knob_names())
        # Each knob on its own, as engine.knobs describes it; num_kv_blocks last, with the pool's needs.
        for name in self.knob_names():
            if name == "num_kv_blocks":
                continue
            high = limits.max_context_len if name == "max_model_len" else None
            reason = KNOB_BY_NAME[name].check(getattr(self, name), high=high)
            if reason is not None:
                raise ConfigError(name, getattr(self, name), reason)
        budget = self.max_num_batched_tokens
        if self.max_num_seqs > budget:
            if "max_num_seqs" in changed:
                raise ConfigError("max_num_seqs", self.max_num_seqs,
                                  f"must be <= max_num_batched_tokens ({budget}): each running sequence needs a "
                                  "token every step")
            raise ConfigError("max_num_batched_tokens", budget, f"must be >= max_num_seqs ({self.max_num_seqs})")
        if self.chunk_size is not None and self.chunk_size > budget:
            if "chunk_size" in changed:
                raise ConfigError("chunk_size", self.chunk_size, f"must be in 1..max_num_batched_tokens ({budget})")
            raise ConfigError("max_num_batched_tokens", budget, f"must be >= chunk_size ({self.chunk_size})")
        # The pool must hold one sequence of the longest allowed length.
        model_len = self.resolved_max_model_len(limits)
        blocks_needed = -(-model_len // self.block_size)
        if self.num_kv_blocks is not None:
            reason = KNOB_BY_NAME["num_kv_blocks"].check(self.num_kv_blocks)
            if reason is not None:
                raise ConfigError("num_kv_blocks", self.num_kv_blocks, reason)
            if self.num_kv_blocks < blocks_needed and "num_kv_blocks" not in changed:
                knob = "max_model_len" if "max_model_len" in changed else "block_size"
                raise ConfigError(knob, getattr(self, knob),
                                  f"needs {blocks_needed} KV blocks but num_kv_blocks is {self.num_kv_blocks}")
            if self.num_kv_blocks < blocks_needed:
                raise ConfigError("num_kv_blocks", self.num_kv_blocks, f"must be an integer >= {blocks_needed}")
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
        raise ConfigError(unknown[0], knobs[unknown[0]], f"unknown knob; known knobs: {', '.join(KNOB_NAMES)}")

