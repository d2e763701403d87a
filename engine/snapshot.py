"""The engine's state after the latest step or command, as one immutable record: the engine thread publishes it,
/metrics, /health and /admin/config read it without a lock."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import EngineConfig, ModelLimits
from engine.config_lease import ConfigLease

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class EngineSnapshot:
    num_running: int
    num_waiting: int
    num_preempted: int
    kv_cache_usage: float
    kv_blocks_used: int
    kv_blocks_free: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    requests_finished: dict[str, int]
    config: EngineConfig
    limits: ModelLimits
    max_model_len: int
    last_step: int
    lease: ConfigLease | None = None
    lease_reverts: int = 0

    @classmethod
    def of(cls, engine: LLMEngine, last_step: int, lease: ConfigLease | None, lease_reverts: int) -> EngineSnapshot:
        """Read from `engine` (in the thread that owns it)."""
        sched = engine.scheduler
        stats = engine.stats
        return cls(
            num_running=sched.num_running, num_waiting=len(sched.waiting), num_preempted=len(sched.preempted),
            kv_cache_usage=sched.kv.usage, kv_blocks_used=sched.kv.num_used_blocks,
            kv_blocks_free=sched.kv.num_free_blocks, prompt_tokens=stats.prompt_tokens,
            generation_tokens=stats.generation_tokens, preemptions=sched.num_preemptions,
            prefix_cache_queries=sched.prefix_cache_queries, prefix_cache_hits=sched.prefix_cache_hits,
            requests_finished=dict(stats.requests_finished), config=engine.config, limits=engine.limits,
            max_model_len=engine.max_model_len, last_step=last_step, lease=lease, lease_reverts=lease_reverts)
