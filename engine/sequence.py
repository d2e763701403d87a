"""One request's state as the scheduler and KV cache see it: token ids, progress and blocks. No torch here."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed, to be recomputed
    SWAPPED = "swapped"  # blocks copied to the host pool
    FINISHED = "finished"

    @property
    def finished(self) -> bool:
        return self is SequenceStatus.FINISHED


_arrival_counter = itertools.count()


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower is served first under the priority policy (as in vLLM)
    arrival_time: float = 0.0
    # Tie-breaker that orders sequences by arrival even when arrival times are equal.
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))

    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    host_block_table: list[int] = field(default_factory=list)  # while SWAPPED
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full, computed blocks
    num_registered_blocks: int = 0  # leading blocks offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    # Kept as a plain field (not a property): the scheduler reads it for every sequence in every step.
    num_tokens: int = field(init=False, default=0)
    num_prompt_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_tokens = self.num_prompt_tokens + len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.num_tokens += 1

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_id(self, index: int) -> int:
        n_prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n_prompt else self.output_token_ids[index - n_prompt]

    def token_slice(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True while the prompt (or, after recompute preemption, the whole history) is being filled in."""
        return self.num_uncomputed_tokens > 1 or self.num_computed_tokens < self.num_prompt_tokens

    def check_length_stop(self, max_model_len: int) -> str | None:
        """The finish reason if the last appended token ends the sequence (stop strings are the engine's job)."""
        last = self.output_token_ids[-1]
        n_out = self.num_tokens - self.num_prompt_tokens
        params = self.params
        if n_out >= params.min_tokens and (
                (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids):
            return "stop"
        if n_out >= params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
