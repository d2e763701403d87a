"""How one request samples and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0.0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        # Accept lists and a single string from callers, store tuples (hashable, immutable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"invalid max_tokens={self.max_tokens!r}: must be an integer >= 1")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"invalid min_tokens={self.min_tokens!r}: must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"invalid min_tokens={self.min_tokens}: must be <= max_tokens ({self.max_tokens})")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"invalid temperature={self.temperature!r}: must be in 0..100")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"invalid top_p={self.top_p!r}: must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"invalid top_k={self.top_k!r}: must be -1, 0 (no cut) or a positive integer")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"invalid seed={self.seed!r}: must be an integer")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"invalid stop={self.stop!r}: must be non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"invalid stop_token_ids={self.stop_token_ids!r}: must be token ids")


@dataclass
class RequestOutput:
    """What a request produced so far; `new_token_ids`/`new_text` are this step's part (for streaming)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0
