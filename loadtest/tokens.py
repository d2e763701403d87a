"""Prompt tokens synthesized from a seed: exact lengths, and shared prefixes exactly where a workload wants them.

A prompt is a concatenation of *segments*; a segment ``(kind, key, length)`` always expands to the same
``length`` token ids for the same ``(seed, kind, key)``. Requests that share leading segments therefore share
their leading tokens token-for-token (what an engine's prefix cache sees), and requests that don't share a
segment share nothing by construction (apart from chance collisions of single random ids).
Ids are drawn uniformly from ``[low, high)``, which by default stays clear of the low ids where tokenizers
keep their special tokens and inside every Llama-family vocabulary (32000 and up).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

# segment kinds
UNIQUE = 0  # key: request index; never shared
BLOCK = 1  # key: a Mooncake hash id; one block of the trace's 512 tokens (scaled)
GROUP = 2  # key: a prefix-group id; the group's system prompt

Segment = tuple[int, int, int]  # (kind, key, length)


@dataclass(frozen=True)
class TokenSpace:
    seed: int = 0
    low: int = 100
    high: int = 32000  # exclusive

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"token range must satisfy 0 <= low < high, got {self.low}:{self.high}")

    @classmethod
    def parse_range(cls, text: str, seed: int = 0) -> "TokenSpace":
        """``"100:32000"`` -> TokenSpace(seed, 100, 32000)."""
        try:
            low, high = (int(x) for x in str(text).split(":"))
        except ValueError:
            raise ValueError(f"token range must look like LOW:HIGH, got {text!r}") from None
        return cls(seed=seed, low=low, high=high)


class PromptBuilder:
    """Expands segments to token ids, caching the shared (non-unique) segments it has already drawn."""

    def __init__(self, space: TokenSpace, cache_size: int = 4096) -> None:
        self.space = space
        self._cache: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()
        self._cache_size = cache_size

    def segment(self, kind: int, key: int, length: int) -> np.ndarray:
        if kind == UNIQUE:
            return self._draw(kind, key, length)
        ck = (kind, key, length)
        arr = self._cache.get(ck)
        if arr is None:
            arr = self._draw(kind, key, length)
            self._cache[ck] = arr
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(ck)
        return arr

    def _draw(self, kind: int, key: int, length: int) -> np.ndarray:
        rng = np.random.default_rng([self.space.seed & 0xFFFFFFFF, kind, key & 0xFFFFFFFFFFFF])
        return rng.integers(self.space.low, self.space.high, size=length, dtype=np.int64)

    def tokens(self, segments: tuple[Segment, ...] | list[Segment], length: int) -> list[int]:
        """The prompt: the segments concatenated and cut to exactly ``length`` ids (a shortfall is an error)."""
        parts = [self.segment(k, key, n) for k, key, n in segments]
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if len(ids) < length:
            raise ValueError(f"segments give {len(ids)} tokens, {length} requested")
        return ids[:length].tolist()
