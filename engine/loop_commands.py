"""The commands the front end sends the engine loop, one dataclass each; the loop dispatches on their type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.prompt import Prompt
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """Admit one HTTP request (one engine request per prompt, all or none); answers a GenerationHandle."""

    prompts: list[Prompt]
    params: SamplingParams
    max_tokens: int | None  # None: what the context leaves after the prompt
    priority: int
    arrival_time: float  # wall clock, for the engine
    arrival: float  # monotonic, for the latency metrics
    request_id: str


@dataclass(frozen=True)
class AbortRequests:
    """Stop these engine requests (their client left); no answer."""

    request_ids: list[str]


@dataclass(frozen=True)
class AbortAll:
    """End every request in flight with a final "abort" delta (the shutdown deadline passed); no answer."""


@dataclass(frozen=True)
class UpdateConfig:
    """Apply knobs, optionally under a lease of `lease_s` seconds; answers the applied EngineConfig."""

    knobs: dict[str, Any]
    lease_s: float | None = None


@dataclass(frozen=True)
class ConfirmConfig:
    """Keep the leased config of `generation`; answers the applied EngineConfig."""

    generation: int


@dataclass(frozen=True)
class ResetPrefixCache:
    """Drop the cached prefix blocks no request holds; answers how many were dropped."""


Command = AddRequest | AbortRequests | AbortAll | UpdateConfig | ConfirmConfig | ResetPrefixCache
