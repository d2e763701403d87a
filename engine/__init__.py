"""slotune's continuous-batching inference engine."""

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
