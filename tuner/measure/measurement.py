"""One measurement of a config at an offered rate, sized by its statistics rather than by a fixed wall time.

A measurement is a sequence of segments (each one trial of the backend: warm-up + a window of
``policy.trial_duration``, its own arrival draw, the prefix cache emptied first). After each segment the pooled
records of all its windows give:

- attainment (the share of requests that attain the SLO) with its Clopper-Pearson interval, against the target
  share (90 %): the figure that decides whether the config serves this rate;
- p99 TBT of the pooled gaps and p99 TTFT of the requests (a request without a first token counts as an infinite
  TTFT), each with its order-statistic interval, against their targets.

The measurement stops as soon as it is decided (:func:`should_stop`): attainment "missed" (no more data can make
the config serve this rate), or attainment "met" with the p99 TBT interval on one side of the target (after at
least ``min_gaps`` gaps). It also stops, "undecided", once the cap can no longer show the share met
(:func:`cannot_reach_by_cap`: "met" needs nearly all of the requests the cap holds to attain, and at an optimistic
reading of the attainment so far the rest are unlikely to): an attainment at the edge, 93 % against 90 %, needs
hundreds of requests, and more windows only spend the run's time. At the cap (``max_segments``) whatever is still
undecided is reported as "undecided", never as met or missed. A segment that fails (rejected config, crashed engine, failed
load test) ends the measurement as "missed" with its reason, as a failed trial always was.

Every window starts from an idle engine. Near a config's TTFT knee the queue builds for longer than one window,
so windows in turn read a rate as served that a minute of it is not (a window's first requests find no queue). A
*sustained* measurement (``sustained_s``, the verdict's) runs the cap's requests as one contiguous window instead,
the length of the independent check of a claimed capacity: a rate it shows served is one the engine sustains that
long, not one it starts well at.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
from scipy import stats

from loadtest.records import RequestRecord, read_records
from loadtest.summary import SLO, attains, token_gaps
from tuner.measure.statistics import (
    DEFAULT_LEVEL,
    Interval,
    Verdict,
    design_effect,
    effective_proportion_interval,
    lower_verdict,
    proportion_interval,
    quantile_interval,
    upper_verdict,
)
from tuner.trials.trial_backend import TrialBackend
from tuner.trials.trial_runner import TrialOutcome

# reasons of a trial that measured nothing usable (tuner.trials.trial_runner): the config fails at this rate
FAILURES = ("rejected", "engine crashed", "load test failed", "could not", "the engine did not become idle")
TARGET_SHARE = 0.9  # DESIGN.md: capacity = the highest rate at which >= 90 % of the requests attain the SLO


@dataclass(frozen=True)
class MeasurementSpec:
    """How a measurement is sized (policy ``measurement``)."""

    level: float = DEFAULT_LEVEL  # two-sided confidence level of every interval
    target_share: float = TARGET_SHARE
    min_gaps: int = 400  # fewer pooled gaps than this never decide a p99 TBT (368 are needed to bound a p99 at 95 %)
    max_segments: int = 3  # the cap: this many windows at most ...
    window_s: float = 0.0  # ... unless a low rate needs more windows (of this length) to hold enough requests
    sustained_s: float = 0.0  # > 0: one contiguous window at least this long instead of windows in turn

    def sustained_window_at(self, rate: float) -> float:
        """A sustained measurement's one window at ``rate``: ``sustained_s``, or the windows the cap holds at this
        rate laid end to end when they are longer (at an infinite rate: the shortest, ``max_segments`` windows)."""
        return max(self.sustained_s, self.segments_at(rate) * self.window_s)

    def segments_at(self, rate: float) -> int:
        """The cap at ``rate``: ``max_segments`` windows, or as many as 1.5x the fewest requests that can show the
        target share take at this rate (36 all-attaining requests for 90 % at 95 %), at most 3x ``max_segments``."""
        if self.window_s <= 0 or rate <= 0:
            return self.max_segments
        needed = 1.5 * fewest_requests_to_show(self.target_share, self.level) / rate
        return max(self.max_segments, min(3 * self.max_segments, math.ceil(needed / self.window_s)))

    def lowest_rate_to_show(self) -> float:
        """The lowest rate whose cap (3x ``max_segments`` windows down there) holds enough requests to show the
        target share even if all of them attain: below it a measurement can only be undecided or missed."""
        if self.window_s <= 0:
            return 0.0
        return fewest_requests_to_show(self.target_share, self.level) / (self.window_s * 3 * self.max_segments)

    def can_show_met(self, rate: float) -> bool:
        return rate >= self.lowest_rate_to_show() * (1 - 1e-9)


def fewest_requests_to_show(share: float, level: float = DEFAULT_LEVEL) -> int:
    """The fewest requests whose attainment, all of them attaining, has a lower bound >= ``share``."""
    return math.ceil(math.log((1 - level) / 2) / math.log(share))


@dataclass(frozen=True)
class Figures:
    """What the pooled windows of a measurement show."""

    requests: int
    attaining: int
    gaps: int
    attainment: Interval
    tbt_p99: Interval
    ttft_p99: Interval
    verdicts: dict[str, Verdict]  # "attainment", "tbt_p99", and "ttft_p99" when the SLO has a TTFT target
    design_effect: float = 1.0  # of the attainment: its interval is on the counts over this (statistics.py)

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "attaining": self.attaining, "gaps": self.gaps,
                "design_effect": self.design_effect,
                "attainment": self.attainment.as_dict(), "tbt_p99": self.tbt_p99.as_dict(),
                "ttft_p99": self.ttft_p99.as_dict(), "verdicts": dict(self.verdicts)}


def figures(records: list[RequestRecord], slo: SLO, spec: MeasurementSpec = MeasurementSpec()) -> Figures:
    """The intervals and verdicts of a set of window records, in the order they were pooled (windows in turn, each in
    send order: the order the design effect's batches follow; simulated windows' clocks overlap, so their send
    times do not give it)."""
    n = len(records)
    outcomes = [attains(r, slo) for r in records]
    attaining = sum(outcomes)
    gaps = np.concatenate([token_gaps(r) for r in records]) if records else np.zeros(0)
    ttfts = np.array([r.ttft if math.isfinite(r.ttft) else math.inf for r in records], dtype=float)
    deff = design_effect(outcomes)
    att = effective_proportion_interval(attaining, n, deff, spec.level)
    tbt = quantile_interval(gaps, 0.99, spec.level)
    with np.errstate(invalid="ignore"):  # a p99 between two infinite TTFTs is infinite, not NaN
        ttft = quantile_interval(ttfts, 0.99, spec.level)
    if n and math.isnan(ttft.value):
        ttft = replace(ttft, value=math.inf)
    verdicts: dict[str, Verdict] = {"attainment": lower_verdict(att, spec.target_share)}
    if slo.tbt_p99 is not None:
        verdicts["tbt_p99"] = upper_verdict(tbt, slo.tbt_p99) if gaps.size >= spec.min_gaps else "undecided"
    if slo.ttft_p99 is not None:
        verdicts["ttft_p99"] = upper_verdict(ttft, slo.ttft_p99)
    return Figures(n, attaining, int(gaps.size), att, tbt, ttft, verdicts, deff)


def should_stop(f: Figures) -> bool:
    """Decided: attainment missed, or attainment met with the p99 TBT on one side of its target. The p99 TTFT is
    reported with its interval but does not hold a measurement open: bounding a p99 of requests from above takes
    368 of them (minutes at a few req/s), and each request's own TTFT already counts in its attainment."""
    if f.verdicts["attainment"] == "missed":
        return True
    return f.verdicts["attainment"] == "met" and f.verdicts.get("tbt_p99", "met") != "undecided"


# The futility rule's optimistic reading of an attainment: the upper end of a one-sided 80 % interval of the share
# so far; and the chance of still reaching "met" by the cap below which the measurement gives up.
OPTIMISTIC_LEVEL = 0.6
FUTILITY_CHANCE = 0.05


@functools.lru_cache(maxsize=4096)
def fewest_attaining_to_show(requests: int, spec: MeasurementSpec) -> int | None:
    """The fewest attaining requests out of ``requests`` whose interval's lower end reaches the target share
    (None: not even all of them do)."""
    def shows(k: int) -> bool:
        return proportion_interval(k, requests, spec.level).low >= spec.target_share

    if requests <= 0 or not shows(requests):
        return None
    lo, hi = 0, requests  # shows(hi) holds; the lower bound grows with k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if shows(mid) else (mid, hi)
    return hi


@functools.lru_cache(maxsize=4096)
def most_attaining_to_miss(requests: int, spec: MeasurementSpec) -> int | None:
    """The most attaining requests out of ``requests`` whose interval's upper end stays below the target share
    (None: not even none of them do)."""
    def misses(k: int) -> bool:
        return proportion_interval(k, requests, spec.level).high < spec.target_share

    if requests <= 0 or not misses(0):
        return None
    lo, hi = 0, requests + 1  # misses(lo) holds; the upper bound grows with k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if misses(mid) else (lo, mid)
    return lo


def out_of_reach(wanted: Verdict, attaining: int, requests: int, total: int, spec: MeasurementSpec,
                 chance: float = FUTILITY_CHANCE) -> bool:
    """Futility: with ``requests`` of ``total`` seen, ``wanted`` ("met" or "missed") is out of reach or nearly so.
    "Met" needs all but a few of the total to attain (one failure in ~55), "missed" all but a few to fail; the
    chance that the rest go that way at an optimistic reading of the share so far (the near end of a
    :data:`OPTIMISTIC_LEVEL` interval) is below ``chance``."""
    left = total - requests
    if requests <= 0 or left <= 0:
        return False
    reading = proportion_interval(attaining, requests, OPTIMISTIC_LEVEL)
    if wanted == "met":
        need = fewest_attaining_to_show(total, spec)
        failures_left = -1 if need is None else (total - need) - (requests - attaining)
        return failures_left < 0 or float(stats.binom.cdf(failures_left, left, 1.0 - reading.high)) < chance
    most = most_attaining_to_miss(total, spec)
    attaining_left = -1 if most is None else most - attaining
    return attaining_left < 0 or float(stats.binom.cdf(attaining_left, left, reading.low)) < chance


def cannot_reach_by_cap(f: Figures, segments_done: int, cap_segments: int, spec: MeasurementSpec,
                        aim: Verdict = "met") -> bool:
    """Futility within a measurement: the attainment is undecided and ``aim`` is out of reach by the cap (its
    requests projected from those so far; :func:`out_of_reach`)."""
    if f.verdicts["attainment"] != "undecided" or segments_done >= cap_segments or f.requests == 0:
        return False
    at_cap = math.ceil(f.requests * cap_segments / segments_done)
    return out_of_reach(aim, f.attaining, f.requests, at_cap, spec)


@dataclass
class Measurement:
    """A config at a rate: the pooled figures of its segments and what they decide."""

    knobs: dict[str, Any]
    rate: float
    figures: Figures | None  # None when the first segment failed
    segments: list[TrialOutcome] = field(default_factory=list)
    reason: str | None = None  # why a segment failed (then the measurement is "missed")
    window_s: float = 0.0  # total measured window time
    stopped: str = ""  # why it stopped before the cap while undecided (the futility rule)

    @property
    def verdict(self) -> Verdict:
        """Whether the config serves this rate: its attainment's verdict against the target share."""
        if self.reason is not None or self.figures is None:
            return "missed"
        return self.figures.verdicts["attainment"]

    @property
    def output_tokens_per_s(self) -> float | None:
        done = [s.summary for s in self.segments if s.summary]
        window = sum(float(s.get("duration_s") or 0.0) for s in done)
        toks = sum(float(s.get("output_tokens_per_s") or 0.0) * float(s.get("duration_s") or 0.0) for s in done)
        return toks / window if window > 0 else None

    @property
    def engine_itl_p99(self) -> float | None:
        """The engine-side inter-token p99 (its histogram's bucket bound) of the last segment, beside the client's."""
        values = [s.summary.get("engine_itl_p99") for s in self.segments if s.summary]
        return max((v for v in values if v is not None), default=None)

    def describe(self) -> str:
        """``attainment 94% (88-98%) met, p99 TBT 41ms (38-45), p99 TTFT 0.6s (0.5-0.9), 112 req / 9k gaps``."""
        if self.figures is None:
            return f"failed: {self.reason}"
        f = self.figures
        v = f.verdicts
        text = (f"attainment {f.attainment.format('%', 100, 3)} {v['attainment']}, "
                f"p99 TBT {f.tbt_p99.format('ms', 1000, 3)}"
                + (f" {v['tbt_p99']}" if "tbt_p99" in v else "")
                + f", p99 TTFT {f.ttft_p99.format('s', 1, 2)}" + (f" {v['ttft_p99']}" if "ttft_p99" in v else "")
                + f" [{f.requests} req" + (f" (design effect {f.design_effect:.1f})" if f.design_effect > 1.05 else "")
                + f", {f.gaps} gaps, {self.window_s:.0f}s")
        itl = self.engine_itl_p99
        if itl is not None:
            text += f"; engine-side p99 ITL <= {itl * 1000:.0f}ms"
        text += "]"
        return text + (f"; {self.reason}" if self.reason else "") + (f"; {self.stopped}" if self.stopped else "")

    def as_dict(self) -> dict[str, Any]:
        return {"knobs": self.knobs, "rate": self.rate, "verdict": self.verdict, "reason": self.reason,
                "stopped": self.stopped, "window_s": self.window_s, "segments": len(self.segments),
                "output_tokens_per_s": self.output_tokens_per_s, "engine_itl_p99": self.engine_itl_p99,
                "figures": self.figures.as_dict() if self.figures else None,
                "dirs": [str(s.out_dir) for s in self.segments if s.out_dir]}


def window_records(outcome: TrialOutcome) -> list[RequestRecord]:
    """The records of a segment's measurement window, read back from its trial folder (both backends write one)."""
    if outcome.out_dir is None or not (Path(outcome.out_dir) / "records.parquet").exists():
        return []
    window = (outcome.summary or {}).get("window")
    records = read_records(str(Path(outcome.out_dir) / "records.parquet"))
    if not window:
        return records
    a, b = float(window[0]), float(window[1])
    return [r for r in records if a <= r.scheduled_at < b]


def segment_seed(draw: int, segment: int) -> int:
    """The arrival seed of segment ``segment`` of draw ``draw``: every config measured on draw d sees the same
    arrivals (common random numbers), and no two segments repeat one."""
    return draw * 1000 + segment


def measure(backend: TrialBackend, knobs: dict[str, Any], rate: float, out_dir: Path, draw: int = 0,
            spec: MeasurementSpec = MeasurementSpec(),
            on_segment: Callable[[Measurement], None] | None = None, aim: Verdict = "met") -> Measurement:
    """Measure ``knobs`` at ``rate`` segment by segment until :func:`should_stop`, the futility rule or the cap
    (sustained, ``spec.sustained_s`` > 0: in one contiguous window, judged at its end). ``aim``: the verdict whose
    futility ends the measurement early ("met" in a search; "missed" where only a miss would tell, as for the
    default config at the rate a candidate needs it to miss)."""
    m = Measurement(knobs=dict(knobs), rate=rate, figures=None)
    pooled: list[RequestRecord] = []
    cap = 1 if spec.sustained_s > 0 else spec.segments_at(rate)
    # a sustained measurement's one window is as long as the cap's windows (or longer), not one window's length
    length = {"duration": spec.sustained_window_at(rate)} if spec.sustained_s > 0 else {}
    for i in range(cap):
        o = backend.run(knobs, Path(out_dir) / f"segment-{i}", rate=rate, seed=segment_seed(draw, i), **length)
        m.segments.append(o)
        m.knobs = dict(o.knobs)
        if o.reason and o.reason.startswith(FAILURES):  # rejected, crashed, failed: the config fails here
            m.reason = o.reason
            return m
        pooled += window_records(o)
        m.window_s += float((o.summary or {}).get("duration_s") or 0.0)
        m.figures = figures(pooled, backend.slo, spec)
        if on_segment is not None:
            on_segment(m)
        if should_stop(m.figures):
            break
        if cannot_reach_by_cap(m.figures, i + 1, cap, spec, aim):
            m.stopped = (f"stopped after {i + 1} of {cap} windows: the ~{math.ceil(m.figures.requests * cap / (i + 1))}"
                         f" requests of the cap cannot show {'' if aim == 'met' else 'below '}"
                         f"{spec.target_share:.0%} at this share")
            break
    return m
