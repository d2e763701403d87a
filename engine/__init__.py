"""slotune's continuous-batching inference engine."""

import os
import sys

# The C++ kernels run on their own work pool (engine/csrc/work_pool.h) beside torch's OpenMP ops (a prefill chunk's
# attention, copies). OpenMP's threads spin for a while after each region by default, on the core the work pool's
# thread needs next: a 512-token bf16 prefill step took 1.35x as long on 2 cores (BENCHMARKS.md, "The engine in bf16
# against vLLM's CPU build"). Sleeping at once costs a region's threads a wake-up, which measured no slower, in fp32
# too. OpenMP reads the variable when torch loads it: set here, before anything imports torch; the user's own
# setting wins.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.config import ConfigError, EngineConfig
from engine.sampling_params import RequestOutput, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "EngineConfig", "ConfigError"]


def __getattr__(name: str) -> type:
    # Torch-backed classes load lazily, so the scheduler and KV-cache bookkeeping import without torch.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
