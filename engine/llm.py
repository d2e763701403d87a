"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, the same call as vLLM's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import RequestOutput, SamplingParams
from engine.step_record import StepRecord


class LLM:
    def __init__(self, model: str | Path | None = None, **kwargs: Any) -> None:
        """`model`: None for the default model, a Hugging Face folder or a .gguf file. Other keyword arguments
        are knobs of `EngineConfig` or engine options (dtype, device, cache_dir, seed, step_log, cuda_graphs)."""
        self.engine = LLMEngine(model, **kwargs)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def update_config(self, **knobs: Any) -> EngineConfig:
        return self.engine.update_config(**knobs)

    def step_records(self, since: int = -1) -> list[StepRecord]:
        return self.engine.step_records(since)

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order."""
        one = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        batch: list[Any] = [prompts] if one else list(prompts)  # each a text or a list of token ids
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(batch)
        if len(params_list) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(params_list)} sampling params")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(batch, params_list)]
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while len(results) < len(ids):
            for output in self.engine.step():
                if output.finished and output.request_id in wanted:
                    results[output.request_id] = output
        return [results[i] for i in ids]

    def chat(self, conversations: list[list[dict[str, str]]],
             params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate replies to chat conversations, formatted with the model's chat template."""
        return self.generate([self.engine.apply_chat_template(c) for c in conversations], params)
