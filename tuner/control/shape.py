"""The live workload's shape: arrival rate, the prompt and output length distributions of the finished requests (the
engine's per-request length histograms), prefix-cache hit rate. The retune rebuilds its simulated workload from it
(tuner.control.candidates) and the drift monitor judges it over time (tuner.control.drift)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tuner.control.window import Lengths, WindowStats


@dataclass(frozen=True)
class Shape:
    """A window's shape."""

    seconds: float
    requests: int  # arrived
    prompt_means: tuple[float, ...]  # one per scrape interval with a finished request (the means without histograms)
    output_means: tuple[float, ...]
    prefix_hit_rate: float
    prompt_lengths: Lengths = Lengths()  # every request that finished in the window
    output_lengths: Lengths = Lengths()

    @property
    def arrival_rate(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else math.nan

    @property
    def mean_prompt(self) -> float:
        """Prompt tokens per finished request over the whole window."""
        if self.prompt_lengths.n:
            return self.prompt_lengths.mean
        return sum(self.prompt_means) / len(self.prompt_means) if self.prompt_means else math.nan

    @property
    def mean_output(self) -> float:
        if self.output_lengths.n:
            return self.output_lengths.mean
        return sum(self.output_means) / len(self.output_means) if self.output_means else math.nan

    def as_dict(self) -> dict[str, Any]:
        def r(x: float) -> float | None:
            return round(x, 4) if math.isfinite(x) else None

        return {"seconds": round(self.seconds, 3), "requests": self.requests, "arrival_rate": r(self.arrival_rate),
                "mean_prompt": r(self.mean_prompt), "mean_output": r(self.mean_output),
                "prefix_hit_rate": r(self.prefix_hit_rate), "prompt_lengths": self.prompt_lengths.as_dict(),
                "output_lengths": self.output_lengths.as_dict()}


def _interval_means(lengths: Lengths, counted: float, finished: int) -> float:
    """One scrape interval's mean length: from the length histogram, or from the token counter over the finished
    requests where the source has no length histograms (the counters count a prompt at its first token)."""
    if lengths.bounds:
        return lengths.mean
    return counted / finished if finished else math.nan


def shape_of(intervals: Sequence[WindowStats]) -> Shape:
    """The shape of consecutive scrape intervals."""
    seconds = sum(w.seconds for w in intervals)
    queries = sum(w.prefix_queries for w in intervals)
    hits = sum(w.prefix_hits for w in intervals)
    prompts = [_interval_means(w.prompt_lengths, w.prompt_tokens, w.finished) for w in intervals]
    outputs = [_interval_means(w.output_lengths, w.generation_tokens, w.finished) for w in intervals]
    prompt_lengths, output_lengths = Lengths(), Lengths()
    for w in intervals:
        prompt_lengths, output_lengths = prompt_lengths + w.prompt_lengths, output_lengths + w.output_lengths
    return Shape(seconds=seconds, requests=sum(w.arrived for w in intervals),
                 prompt_means=tuple(m for m in prompts if math.isfinite(m)),
                 output_means=tuple(m for m in outputs if math.isfinite(m)),
                 prefix_hit_rate=hits / queries if queries else math.nan,
                 prompt_lengths=prompt_lengths, output_lengths=output_lengths)
