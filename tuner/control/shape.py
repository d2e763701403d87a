"""The live workload's shape and its drift: arrival rate, the prompt and output length distributions of the finished
requests (the engine's per-request length histograms), prefix-cache hit rate. A shift counts as drift only when a
test shows it beyond the policy's threshold, never on a raw difference:

- the arrival rate and the mean prompt and output lengths: the quantity's ratio to the reference window has a
  confidence interval entirely outside [1/(1+t), 1+t];
- the prompt and output length distributions: a chi-square test of homogeneity of the two windows' bucket counts
  rejects at DISTRIBUTION_ALPHA, with at least the policy's ``min_requests`` finished requests on each side, and at
  least a share t of the requests changed length class (the total variation distance over the tested buckets).

The mean tests stay beside the distribution tests because each sees what the other cannot. A bucket spans up to 2.5x
(1-2-5 steps), so prompts that grow from 210 to 480 tokens stay in one bucket and only the histogram's sum shows it;
and a test of homogeneity at a fixed level flags any difference at all once the windows hold enough requests, while
the mean test carries the policy's threshold as the size of the change. The distribution test sees what the means
hide: a mix that changes at the same mean (medium prompts replaced by short and long ones), and it uses every
request rather than one mean per scrape interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tuner.control.window import Lengths, WindowStats
from tuner.measure.statistics import Homogeneity, Interval, homogeneity_test, mean_ratio_interval, rate_ratio_interval

# The level of each length distribution's test: stricter than the other tests' 95 % intervals, which the threshold
# makes conservative while this test at a small sample size is not (chance alone moves a third of 40 requests' mass),
# and the trigger judges a window sliding past the same reference at every scrape.
DISTRIBUTION_ALPHA = 0.01


@dataclass(frozen=True)
class Shape:
    """A window's shape, with the samples its drift tests need."""

    seconds: float
    requests: int  # arrived
    prompt_means: tuple[float, ...]  # one per scrape interval with a finished request (the mean tests' samples)
    output_means: tuple[float, ...]
    prefix_hit_rate: float
    prompt_lengths: Lengths = Lengths()  # every request that finished in the window (the distribution tests')
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


class DriftCheck(Protocol):
    """One drift test of a shape quantity, recent against reference."""

    @property
    def quantity(self) -> str: ...

    @property
    def drifted(self) -> bool: ...

    def describe(self) -> str: ...

    def as_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class DriftTest:
    """A ratio recent / reference with its interval, against the threshold."""

    quantity: str
    ratio: Interval  # recent / reference
    threshold: float

    @property
    def drifted(self) -> bool:
        return self.ratio.n > 0 and (self.ratio.low > 1 + self.threshold or
                                     self.ratio.high < 1 / (1 + self.threshold))

    def describe(self) -> str:
        return f"{self.quantity} x{self.ratio.format()}"

    def as_dict(self) -> dict[str, Any]:
        return {"quantity": self.quantity, "ratio": self.ratio.as_dict(), "threshold": self.threshold,
                "drifted": self.drifted}


@dataclass(frozen=True)
class DistributionTest:
    """The chi-square test of homogeneity of two windows' length histograms (recent: ``counts_a``), against the
    level and the threshold (as a share of requests that changed length class)."""

    quantity: str
    test: Homogeneity
    bounds: tuple[float, ...]  # the histograms' bucket upper bounds (the groups index them)
    n: tuple[int, int]  # finished requests: recent, reference
    min_observations: int
    threshold: float
    alpha: float = DISTRIBUTION_ALPHA

    @property
    def enough(self) -> bool:
        return min(self.n) >= self.min_observations

    @property
    def significant(self) -> bool:
        """The test rejects the same distribution at its level (whatever the size of the change)."""
        return self.enough and math.isfinite(self.test.p_value) and self.test.p_value < self.alpha

    @property
    def drifted(self) -> bool:
        return self.significant and self.test.distance >= self.threshold

    def group_bounds(self) -> list[str]:
        """Each tested group as the range of lengths it holds, e.g. ``21-50``."""
        def upper(i: int) -> str:
            return "inf" if math.isinf(self.bounds[i]) else f"{self.bounds[i]:g}"

        return [f"{(self.bounds[i - 1] + 1 if i else 0):g}-{upper(j)}" for i, j in self.test.groups]

    def describe(self) -> str:
        return (f"{self.quantity} p={self.test.p_value:.2g}, {self.test.distance:.0%} of requests changed length "
                f"class")

    def as_dict(self) -> dict[str, Any]:
        return {"quantity": self.quantity, "test": "chi-square homogeneity", **self.test.as_dict(),
                "groups": self.group_bounds(), "n": list(self.n), "min_observations": self.min_observations,
                "alpha": self.alpha, "threshold": self.threshold, "drifted": self.drifted}


def distribution_test(quantity: str, recent: Lengths, reference: Lengths, threshold: float,
                      min_observations: int) -> DistributionTest:
    """Untestable (a NaN p-value) when a window has no histogram, or the two have different buckets (an engine
    upgraded in between)."""
    bounds = recent.bounds or reference.bounds
    comparable = recent.bounds == reference.bounds
    test = homogeneity_test(recent.counts, reference.counts) if comparable else homogeneity_test((), ())
    return DistributionTest(quantity, test, bounds, (recent.n, reference.n), min_observations, threshold)


def drift_tests(recent: Shape, reference: Shape, threshold: float, min_observations: int = 1) -> list[DriftCheck]:
    """The arrival rate (exact Poisson rate ratio), the mean prompt and output lengths (Welch intervals of the
    per-interval means) and the prompt and output length distributions (chi-square homogeneity of the windows'
    bucket counts, each window with at least ``min_observations`` finished requests), recent against reference.
    The prefix-cache hit rate is tracked but not tested: the tokens of one prompt are not independent trials."""
    return [DriftTest("arrival_rate", rate_ratio_interval(recent.requests, recent.seconds, reference.requests,
                                                          reference.seconds), threshold),
            DriftTest("mean_prompt", mean_ratio_interval(recent.prompt_means, reference.prompt_means), threshold),
            DriftTest("mean_output", mean_ratio_interval(recent.output_means, reference.output_means), threshold),
            distribution_test("prompt_lengths", recent.prompt_lengths, reference.prompt_lengths, threshold,
                              min_observations),
            distribution_test("output_lengths", recent.output_lengths, reference.output_lengths, threshold,
                              min_observations)]
