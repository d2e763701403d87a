"""The live workload's shape and its drift: arrival rate, mean prompt and output lengths (one sample per scrape
interval), prefix-cache hit rate; a shift counts as drift only when a test shows it beyond the policy's threshold
(the quantity's ratio to the reference window has a confidence interval entirely outside [1/(1+t), 1+t]), never on a
raw difference."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tuner.control.window import WindowStats
from tuner.measure.statistics import Interval, mean_ratio_interval, rate_ratio_interval


@dataclass(frozen=True)
class Shape:
    """A window's shape, with the per-interval samples its drift test needs."""

    seconds: float
    requests: int  # arrived
    prompt_means: tuple[float, ...]  # one per scrape interval with a finished request (the drift test's samples)
    output_means: tuple[float, ...]
    prefix_hit_rate: float
    finished: int = 0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0

    @property
    def arrival_rate(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else math.nan

    @property
    def mean_prompt(self) -> float:
        """Prompt tokens per finished request over the whole window (the per-interval means are noisier: a
        request's prompt is counted at its first token, its finish later)."""
        if self.finished:
            return self.prompt_tokens / self.finished
        return sum(self.prompt_means) / len(self.prompt_means) if self.prompt_means else math.nan

    @property
    def mean_output(self) -> float:
        if self.finished:
            return self.generation_tokens / self.finished
        return sum(self.output_means) / len(self.output_means) if self.output_means else math.nan

    def as_dict(self) -> dict[str, Any]:
        def r(x: float) -> float | None:
            return round(x, 4) if math.isfinite(x) else None

        return {"seconds": round(self.seconds, 3), "requests": self.requests, "arrival_rate": r(self.arrival_rate),
                "mean_prompt": r(self.mean_prompt), "mean_output": r(self.mean_output),
                "prefix_hit_rate": r(self.prefix_hit_rate)}


def shape_of(intervals: Sequence[WindowStats]) -> Shape:
    """The shape of consecutive scrape intervals."""
    seconds = sum(w.seconds for w in intervals)
    queries = sum(w.prefix_queries for w in intervals)
    hits = sum(w.prefix_hits for w in intervals)
    busy = [w for w in intervals if w.finished > 0]
    return Shape(seconds=seconds, requests=sum(w.arrived for w in intervals),
                 prompt_means=tuple(w.mean_prompt for w in busy), output_means=tuple(w.mean_output for w in busy),
                 prefix_hit_rate=hits / queries if queries else math.nan, finished=sum(w.finished for w in intervals),
                 prompt_tokens=sum(w.prompt_tokens for w in intervals),
                 generation_tokens=sum(w.generation_tokens for w in intervals))


@dataclass(frozen=True)
class DriftTest:
    quantity: str
    ratio: Interval  # recent / reference
    threshold: float

    @property
    def drifted(self) -> bool:
        return self.ratio.n > 0 and (self.ratio.low > 1 + self.threshold or
                                     self.ratio.high < 1 / (1 + self.threshold))

    def as_dict(self) -> dict[str, Any]:
        return {"quantity": self.quantity, "ratio": self.ratio.as_dict(), "threshold": self.threshold,
                "drifted": self.drifted}


def drift_tests(recent: Shape, reference: Shape, threshold: float) -> list[DriftTest]:
    """The arrival rate (exact Poisson rate ratio) and the mean prompt and output lengths (Welch intervals of the
    per-interval means), recent against reference. The prefix-cache hit rate is tracked but not tested: the tokens
    of one prompt are not independent trials."""
    return [DriftTest("arrival_rate", rate_ratio_interval(recent.requests, recent.seconds, reference.requests,
                                                          reference.seconds), threshold),
            DriftTest("mean_prompt", mean_ratio_interval(recent.prompt_means, reference.prompt_means), threshold),
            DriftTest("mean_output", mean_ratio_interval(recent.output_means, reference.output_means), threshold)]
