"""What happened between two scrapes: the requests that finished, how many attained the SLO, and the workload's
shape (arrivals, the prompt and output lengths of the finished requests, prefix-cache hit rate).

Attainment as the project defines it: a request attains when its own p99 inter-token gap is within the TBT target
(and its TTFT within the TTFT target when set). The engine exports each finished request's own p99 gap as a histogram, so the
attaining count is that histogram's bucket at the target, as an increase between the scrapes, over all requests
that finished (aborted ones do not attain). A target between two bucket bounds is read at the bound below it (only
requests sure to attain count). With a TTFT target the engine's two histograms give the marginal counts only, and
count at different moments: the TBT one at a request's finish, the TTFT one at its first token. The attaining count
is the requests that finished less the larger of the two targets' misses, each as its own histogram counts them (an
upper bound of the joint count). Not the smaller of the two attaining counts: in a window where more requests finish
than start (a queue draining, a block after a switch) the TTFT histogram holds fewer requests than finished, and
every request it did not see would read as a miss.

The lengths come from the engine's per-request histograms (``slotune_request_prompt_tokens``,
``slotune_request_generation_tokens``): both observed when a request finishes, so a window's prompt and output
lengths are those of the same requests (the token counters count a prompt at its first token, its finish later).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine import metric_names as names
from slotune.slo import SLO
from slotune.units import format_duration
from tuner.control.sources import Scrape
from tuner.measure.statistics import Interval, proportion_interval

MIN_QUEUE_GROWTH = 3  # requests: a window whose queue grew by fewer (or by under 10 % of its finished) kept up


@dataclass
class LookClock:
    """Consecutive, non-overlapping looks of ``length`` seconds: where the next one begins (None before the first
    poll, or after a decision, whose next look starts afresh)."""

    length: float
    start: float | None = None

    def due(self, now: float) -> float | None:
        """The start of the look that ends at ``now`` when one is due (the next then starts at ``now``)."""
        if self.start is None:
            self.start = now
        if now - self.start < self.length:
            return None
        begun, self.start = self.start, now
        return begun

    def restart(self) -> None:
        self.start = None


class CounterReset(ValueError):
    """A counter went down between two scrapes: the engine restarted; the window means nothing."""


def bucket_at(scrape: Scrape, histogram: str, target: float) -> tuple[float, float]:
    """(the count at the largest bucket bound <= target, that bound) of a histogram; (0, nan) without one."""
    buckets = {float(le): v for le, v in scrape.labelled(names.bucket(histogram), "le").items()}
    bounds = [b for b in buckets if b <= target * (1 + 1e-9)]
    if not bounds:
        return 0.0, math.nan
    bound = max(bounds)
    return buckets[bound], bound


def target_histograms(slo: SLO) -> dict[str, tuple[str, float | None]]:
    """Each SLO target's name: the engine histogram it is read from and its value (None: not set)."""
    return {"TBT": (names.REQUEST_ITL_P99, slo.tbt_p99), "TTFT": (names.TTFT, slo.ttft_p99),
            "E2E": (names.E2E, slo.e2e_p99)}


def off_bucket_targets(scrape: Scrape, slo: SLO) -> list[str]:
    """A sentence for each SLO target that is not a bucket bound of the engine's histogram it is read from: it is
    read at the bound below, so requests between the two count as missing and attainment reads low."""
    notes = []
    for name, (histogram, target) in target_histograms(slo).items():
        if target is None:
            continue
        _, bound = bucket_at(scrape, histogram, target)
        if math.isfinite(bound) and not math.isclose(bound, target, rel_tol=1e-9):
            notes.append(f"the {name} target {format_duration(target)} is not a bucket bound of {histogram}: it is "
                         f"read at {format_duration(bound)}, so requests between the two count as missing and "
                         "attainment reads low (a target on a bound reads exactly)")
    return notes


@dataclass(frozen=True)
class Lengths:
    """What a length histogram gained over a window: finished requests per bucket (not cumulative; ``bounds`` are
    the buckets' upper bounds, ascending, the last one +inf) and the sum of their lengths."""

    bounds: tuple[float, ...] = ()
    counts: tuple[float, ...] = ()
    total: float = 0.0

    @property
    def n(self) -> int:
        return round(sum(self.counts))

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else math.nan

    def ranges(self) -> list[tuple[int, int, float]]:
        """(lowest, highest length, requests) of each bucket that holds requests. A bucket spans from above the
        previous bound to its own; the last (+Inf) one from above the highest bound to twice it."""
        out = []
        below = 0.0
        for bound, count in zip(self.bounds, self.counts):
            if count > 0:
                high = bound if math.isfinite(bound) else 2 * max(below, 1.0)
                out.append((int(below) + 1, max(int(below) + 1, int(high)), float(count)))
            below = bound if math.isfinite(bound) else below
        return out

    def __add__(self, other: Lengths) -> Lengths:
        """Two windows' lengths together (consecutive windows of one engine: the same buckets)."""
        if not other.bounds:
            return self
        if not self.bounds:
            return other
        if self.bounds != other.bounds:
            raise ValueError(f"length histograms with different buckets: {self.bounds} and {other.bounds}")
        return Lengths(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts)), self.total + other.total)

    def as_dict(self) -> dict[str, Any]:
        """The buckets that gained requests, by their upper bound (``le``, as Prometheus writes it)."""
        return {"n": self.n, "mean": round(self.mean, 4) if self.n else None,
                "buckets": {("+Inf" if math.isinf(b) else f"{b:g}"): round(c) for b, c in zip(self.bounds,
                                                                                               self.counts) if c}}


def _cumulative(scrape: Scrape, histogram: str) -> dict[float, float]:
    return {float(le): v for le, v in scrape.labelled(names.bucket(histogram), "le").items()}


def lengths_between(before: Scrape, after: Scrape, histogram: str) -> Lengths:
    """The increase of a length histogram between two scrapes (empty when the source has no such histogram).
    Raises CounterReset when a bucket went down."""
    cum_after, cum_before = _cumulative(after, histogram), _cumulative(before, histogram)
    if not cum_after:
        return Lengths()
    bounds = tuple(sorted(cum_after))
    grown = []
    for b in bounds:
        d = cum_after[b] - cum_before.get(b, 0.0)
        if d < -1e-9:
            raise CounterReset(f"{histogram}_bucket{{le={b:g}}} went down from {cum_before.get(b, 0.0):g} to "
                               f"{cum_after[b]:g}: the engine restarted")
        grown.append(max(0.0, d))
    # each bucket's own count (a cumulative bucket only grows, so these are >= 0 up to rounding)
    counts = tuple(max(0.0, c - (grown[i - 1] if i else 0.0)) for i, c in enumerate(grown))
    total = after.get(names.hist_sum(histogram)) - before.get(names.hist_sum(histogram))
    if total < -1e-9:
        raise CounterReset(f"{histogram}_sum went down: the engine restarted")
    return Lengths(bounds, counts, max(0.0, total))


@dataclass(frozen=True)
class WindowStats:
    start: float
    end: float
    finished: int  # requests that finished (stop, length or abort)
    arrived: int  # requests that came in: finished plus the growth of the engine's queues
    attaining: int
    tbt_bound: float  # the bucket bound the TBT target was read at
    prompt_tokens: float
    generation_tokens: float
    prefix_queries: float
    prefix_hits: float
    generations: tuple[int, int]  # config generation at the start and end
    prompt_lengths: Lengths = Lengths()  # of the requests that finished on stop or length
    output_lengths: Lengths = Lengths()
    mean_gap: float = math.nan  # seconds between two tokens of one request, over the window's gaps
    # each target's misses as its own histogram counts them, unclipped: the TBT and E2E ones at a request's finish,
    # the TTFT one at its first token, so consecutive windows' figures add up to their span's (the attaining count
    # above, finished less the largest of them and clipped per window, does not)
    missed_tbt: float = 0.0
    missed_ttft: float = 0.0
    missed_e2e: float = 0.0

    @property
    def service_s(self) -> float:
        """How long a finished request took from its first token to its last (its mean output times the mean gap):
        the time a request admitted under one config still runs after a switch to another."""
        return self.mean_output * self.mean_gap if self.finished else math.nan

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def attainment(self) -> Interval:
        return proportion_interval(self.attaining, self.finished)

    @property
    def kept_up(self) -> bool:
        """Its queue did not grow: by fewer than MIN_QUEUE_GROWTH requests or 10 % of those that finished."""
        return self.arrived - self.finished < max(MIN_QUEUE_GROWTH, 0.1 * self.finished)

    @property
    def arrival_rate(self) -> float:
        """Requests that arrived per second (finished ones plus the queues' growth: right under overload too)."""
        return self.arrived / self.seconds if self.seconds > 0 else math.nan

    @property
    def mean_prompt(self) -> float:
        return self.prompt_tokens / self.finished if self.finished else math.nan

    @property
    def mean_output(self) -> float:
        return self.generation_tokens / self.finished if self.finished else math.nan

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else math.nan

    def as_dict(self) -> dict[str, Any]:
        def finite(x: float) -> float | None:
            return round(x, 6) if math.isfinite(x) else None

        return {"start": self.start, "end": self.end, "finished": self.finished, "arrived": self.arrived,
                "attaining": self.attaining,
                "attainment": self.attainment.as_dict(), "arrival_rate": finite(self.arrival_rate),
                "mean_prompt": finite(self.mean_prompt), "mean_output": finite(self.mean_output),
                "prefix_hit_rate": finite(self.prefix_hit_rate), "service_s": finite(self.service_s),
                "generations": list(self.generations)}


def window(before: Scrape, after: Scrape, slo: SLO) -> WindowStats:
    """The window between two scrapes. Raises CounterReset when a counter went down (an engine restart)."""
    def delta(value_after: float, value_before: float, what: str) -> float:
        d = value_after - value_before
        if d < -1e-9:
            raise CounterReset(f"{what} went down from {value_before:g} to {value_after:g}: the engine restarted")
        return max(0.0, d)

    targets = target_histograms(slo)
    tbt_histogram, tbt = targets["TBT"]
    assert tbt is not None
    ok_after, bound = bucket_at(after, tbt_histogram, tbt)
    ok_before, _ = bucket_at(before, tbt_histogram, tbt)
    attaining = delta(ok_after, ok_before, "the TBT-attaining count")
    reasons = after.labelled(names.total(names.REQUEST_SUCCESS), "finished_reason")
    reasons_before = before.labelled(names.total(names.REQUEST_SUCCESS), "finished_reason")
    finished = sum(delta(v, reasons_before.get(k, 0.0), f"finished requests ({k})") for k, v in reasons.items())
    missed_tbt = finished - attaining

    def misses(what: str) -> float:
        """The observations of ``what``'s histogram in the window above its target (0 without a target). The TBT
        target is read otherwise above: finished less the bucket, so that an aborted request counts as missed."""
        histogram, target = targets[what]
        if target is None:
            return 0.0
        ok = delta(bucket_at(after, histogram, target)[0], bucket_at(before, histogram, target)[0],
                   f"the {what}-attaining count")
        return delta(after.get(names.hist_count(histogram)), before.get(names.hist_count(histogram)),
                     f"the {what} observations") - ok

    missed_ttft = misses("TTFT")
    missed_e2e = misses("E2E")  # of the requests that finished on stop or length
    attaining = min(attaining, finished - missed_ttft, finished - missed_e2e)
    # A request may finish between the two histogram reads of one scrape: never more attaining than finished.
    finished_n = round(finished)
    return WindowStats(
        start=before.time, end=after.time, finished=finished_n,
        arrived=max(0, finished_n + queued(after) - queued(before)), attaining=min(round(attaining), finished_n),
        tbt_bound=bound,
        prompt_tokens=delta(after.get(names.total(names.PROMPT_TOKENS)), before.get(names.total(names.PROMPT_TOKENS)),
                            "prompt tokens"),
        generation_tokens=delta(after.get(names.total(names.GENERATION_TOKENS)),
                                before.get(names.total(names.GENERATION_TOKENS)), "generated tokens"),
        prefix_queries=delta(after.get(names.total(names.PREFIX_QUERIES)),
                             before.get(names.total(names.PREFIX_QUERIES)), "prefix-cache queries"),
        prefix_hits=delta(after.get(names.total(names.PREFIX_HITS)), before.get(names.total(names.PREFIX_HITS)),
                          "prefix-cache hits"),
        generations=(int(before.get(names.CONFIG_GENERATION)), int(after.get(names.CONFIG_GENERATION))),
        prompt_lengths=lengths_between(before, after, names.REQUEST_PROMPT_TOKENS),
        output_lengths=lengths_between(before, after, names.REQUEST_GENERATION_TOKENS),
        mean_gap=_mean_between(before, after, names.INTER_TOKEN_LATENCY), missed_tbt=missed_tbt,
        missed_ttft=missed_ttft, missed_e2e=missed_e2e)


def _mean_between(before: Scrape, after: Scrape, histogram: str) -> float:
    """The mean of a histogram's observations between two scrapes (nan without any)."""
    count = after.get(names.hist_count(histogram)) - before.get(names.hist_count(histogram))
    return (after.get(names.hist_sum(histogram)) - before.get(names.hist_sum(histogram))) / count if count > 0 else math.nan


def queued(scrape: Scrape) -> int:
    """Requests in the engine (running, waiting or preempted) at a scrape."""
    return round(sum(scrape.get(q) for q in names.QUEUES))


def knobs_of(scrape: Scrape) -> dict[str, float]:
    """The applied knob values the engine exports (numbers; see engine metrics ``slotune_knob``)."""
    return scrape.labelled(names.KNOB, "name")
