"""One measurement of a config at an offered rate, sized by its statistics rather than by a fixed wall time.

A measurement is a sequence of segments (each one trial of the backend: warm-up + a window of
``policy.trial_duration``, its own arrival draw, the prefix cache emptied first). After each segment the pooled
records of all its windows give:

- attainment (the share of requests that attain the SLO) with the confidence sequence of its *blocks*
  (tuner/measure/dependence.py): each window's requests in send order, cut into blocks of the requests that arrive in
  ``spec.block_s`` seconds (at least three): requests that queue behind one burst or share one slow step attain or
  miss together, so a block, not a request, is the unit of evidence; against the target share (90 %) it decides
  whether the config serves this rate. A confidence sequence holds at every look, so looking after each window costs
  nothing;
- the share of requests whose own p99 gap is within the TBT target (the SLO's per-request definition of TBT), on the
  same blocks;
- the p99 of the pooled gaps (a diagnostic: one step's gap repeats once per running sequence, so its interval counts
  the gaps ending in one stretch of ``GAP_CLUSTER_S`` as one cluster) and the p99 TTFT of the requests (its interval
  on the attainment's blocks), each against its target.

The measurement stops as soon as the attainment is decided (met or missed), or once neither is within reach by the
cap (:func:`cannot_decide_by_cap`). At the cap whatever is still open is "undecided": it bounds nothing.

A segment that fails for the config (rejected by the engine, the engine crashed under it) ends the measurement as
"missed" with its reason. A failure of the measuring machinery (the load generator failed, the engine was not idle,
the machine was busy with other processes) is no evidence about the config: the segment is run again once, and a
second failure leaves the measurement *void* with its reason ("undecided", never missed).

Every window starts from an idle engine. Near a config's TTFT knee the queue builds for longer than one window, so
windows in turn read a rate as served that a minute of it is not. A *sustained* measurement (``sustained_s``, the
verdict's) runs as one contiguous window instead: a rate it shows served is one the engine sustains that long.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from loadtest.records import RequestRecord, read_records
from slotune.slo import SLO
from loadtest.summary import attains, request_tbt_p99, token_gaps
from tuner.measure.dependence import Block, attainment_interval, block_counts, clustered_quantile_interval
from tuner.measure.targets import Reached, reached
from tuner.measure.statistics import DEFAULT_LEVEL, Interval, Verdict, lower_verdict, upper_verdict
from tuner.trials.trial_backend import TrialBackend
from tuner.trials.trial_runner import TrialOutcome
from slotune import result_files as files

# reasons of a trial that fails for the config (tuner.trials.trial_runner): the config does not serve this rate
CONFIG_FAILURES = ("rejected", "engine crashed")
# reasons of a trial whose measuring machinery failed: no evidence about the config
MACHINERY_FAILURES = ("load test failed", "could not", "the engine did not become idle", "the machine was busy")
MACHINERY_RETRIES = 1  # a segment whose machinery failed is run again this many times before the measurement is void
TARGET_SHARE = 0.9  # capacity = the highest rate at which >= 90 % of the requests attain the SLO
MIN_BLOCK = 3  # requests: a block holds at least this many, however low the rate
GAP_CLUSTER_S = 1.0  # the pooled gaps ending within this many seconds count as one cluster (one step's gaps and its
# neighbours')


@dataclass(frozen=True)
class MeasurementSpec:
    """How a measurement is sized and judged (policy ``measurement``)."""

    level: float = DEFAULT_LEVEL  # two-sided confidence level of every interval
    target_share: float = TARGET_SHARE
    min_gaps: int = 400  # fewer pooled gaps than this never decide a p99 TBT
    max_segments: int = 3  # the cap: this many windows at most
    window_s: float = 0.0  # a window's length (0: the backend's own)
    sustained_s: float = 0.0  # > 0: one contiguous window at least this long instead of windows in turn
    block_s: float = 3.0  # the requests arriving in this many seconds form one block (longer than a queue episode)

    def block_at(self, rate: float) -> int:
        """Requests per block at ``rate``: those of ``block_s`` seconds, at least MIN_BLOCK."""
        return max(MIN_BLOCK, math.ceil(rate * self.block_s - 1e-9)) if rate > 0 else MIN_BLOCK

    def seconds_for_blocks(self, blocks: int, rate: float) -> float:
        """Seconds of arrivals at ``rate`` that hold ``blocks`` blocks (``block_s`` each at 1 req/s and above; below,
        a block of MIN_BLOCK requests spans longer)."""
        return blocks * (self.block_at(rate) / rate if rate > 0 else self.block_s)

    def seconds_to_show(self, rate: float, margin: float = 1.0) -> float:
        """Seconds of arrivals at ``rate`` that hold ``margin`` times the fewest blocks that can show the target
        share met (:meth:`blocks_to_show`): a measurement sized to decide, whatever the rate."""
        return self.seconds_for_blocks(math.ceil(margin * self.blocks_to_show()), rate)

    def segments_at(self, rate: float) -> int:
        """The cap in windows at ``rate``: ``max_segments``, or more below 1 req/s, so that the cap holds as many
        blocks (as much evidence) at every rate. A measurement is sized by its requests, not its seconds: 45 s at
        0.3 req/s would hold five blocks of three requests and could decide nothing."""
        if self.window_s <= 0 or rate <= 0:
            return self.max_segments
        blocks = self.max_segments * self.window_s / self.block_s
        return max(self.max_segments, math.ceil(self.seconds_for_blocks(math.ceil(blocks - 1e-9), rate)
                                                / self.window_s - 1e-9))

    def sustained_window_at(self, rate: float) -> float:
        """A sustained measurement's one window: ``sustained_s``, or as long as the cap's windows laid end to end."""
        return max(self.sustained_s, self.segments_at(rate) * self.window_s)

    def blocks_to_show(self) -> int:
        """The fewest blocks that can show the target share met at this level (every request of each attaining)."""
        return _blocks_to_show(self.level, self.target_share)


def _blocks_to_show(level: float, share: float) -> int:
    k = 1
    while attainment_interval([(1, 1)] * k, level, share).low < share:
        k += 1 if k < 16 else max(1, k // 16)
    while k > 1 and attainment_interval([(1, 1)] * (k - 1), level, share).low >= share:
        k -= 1
    return k


@dataclass(frozen=True)
class Figures:
    """What the pooled windows of a measurement show."""

    requests: int
    attaining: int
    gaps: int
    attainment: Interval
    tbt_attainment: Interval  # the share of requests whose own p99 gap is within the TBT target
    tbt_p99: Interval  # of the pooled gaps (a diagnostic, clustered in time)
    ttft_p99: Interval
    verdicts: dict[str, Verdict]  # "attainment", "tbt_p99", and "ttft_p99" when the SLO has a TTFT target
    blocks: tuple[Block, ...] = ()  # (attaining, requests) of each block, windows in turn
    block: int = MIN_BLOCK  # requests per block
    reached: Reached | None = None  # each target on its own: the share within it, the target the share would meet

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "attaining": self.attaining, "gaps": self.gaps, "block": self.block,
                "blocks": [list(b) for b in self.blocks], "attainment": self.attainment.as_dict(),
                "tbt_attainment": self.tbt_attainment.as_dict(), "tbt_p99": self.tbt_p99.as_dict(),
                "ttft_p99": self.ttft_p99.as_dict(), "verdicts": dict(self.verdicts),
                "reached": self.reached.as_dict() if self.reached is not None else None}


def figures(windows: list[list[RequestRecord]], slo: SLO, spec: MeasurementSpec = MeasurementSpec(),
            rate: float = 0.0) -> Figures:
    """The intervals and verdicts of the records of one or more windows at ``rate`` (each window's requests in send
    order, cut into blocks of ``spec.block_at(rate)``; no block spans two windows)."""
    block = spec.block_at(rate)
    rest = replace(slo, tbt_p99=None)  # the targets besides TBT (a request's own p99 gap is judged once, below)
    ordered = [sorted(w, key=lambda r: r.scheduled_at) for w in windows]
    records = [r for w in ordered for r in w]
    blocks: list[Block] = []
    tbt_blocks: list[Block] = []
    request_cluster: list[int] = []
    gap_list: list[np.ndarray] = []
    gap_cluster: list[np.ndarray] = []
    for w in ordered:
        tbt_ok = [r.status == "ok" and (slo.tbt_p99 is None or request_tbt_p99(r) <= slo.tbt_p99) for r in w]
        outcomes = [ok and attains(r, rest) for r, ok in zip(w, tbt_ok)]
        first = len(blocks)
        blocks += block_counts(outcomes, block)
        tbt_blocks += block_counts(tbt_ok, block)
        request_cluster += [first + i for i, (_, n) in enumerate(blocks[first:]) for _ in range(n)]
        origin = min((r.intended_send_time for r in w), default=0.0)
        base = int(max(c.max() for c in gap_cluster)) + 1 if gap_cluster else 0
        for r in w:
            g = token_gaps(r)
            if g.size:  # each gap clustered by when it ended (its second token's arrival, epoch seconds)
                gap_list.append(g)
                ends = np.asarray(r.token_times[1:], dtype=float) - origin
                gap_cluster.append(base + np.floor(ends / GAP_CLUSTER_S).astype(int))
    n = len(records)
    attaining = sum(a for a, _ in blocks)
    gaps = np.concatenate(gap_list) if gap_list else np.zeros(0)
    clusters = np.concatenate(gap_cluster) if gap_cluster else np.zeros(0, dtype=int)
    ttfts = np.array([r.ttft if math.isfinite(r.ttft) else math.inf for r in records], dtype=float)
    att = attainment_interval(blocks, spec.level, spec.target_share)
    tbt_att = attainment_interval(tbt_blocks, spec.level, spec.target_share)
    tbt = clustered_quantile_interval(gaps, clusters, 0.99, spec.level)
    with np.errstate(invalid="ignore"):  # a p99 between two infinite TTFTs is infinite, not NaN
        ttft = clustered_quantile_interval(ttfts, np.array(request_cluster, dtype=int), 0.99, spec.level)
    if n and math.isnan(ttft.value):
        ttft = replace(ttft, value=math.inf)
    verdicts: dict[str, Verdict] = {"attainment": lower_verdict(att, spec.target_share)}
    if slo.tbt_p99 is not None:
        verdicts["tbt_p99"] = upper_verdict(tbt, slo.tbt_p99) if gaps.size >= spec.min_gaps else "undecided"
    if slo.ttft_p99 is not None:
        verdicts["ttft_p99"] = upper_verdict(ttft, slo.ttft_p99)
    own_ttfts = [[r.ttft if r.status == "ok" and math.isfinite(r.ttft) else math.inf for r in w] for w in ordered]
    own_tbts = [[request_tbt_p99(r) if r.status == "ok" else math.inf for r in w] for w in ordered]
    return Figures(n, attaining, int(gaps.size), att, tbt_att, tbt, ttft, verdicts, tuple(blocks), block,
                   reached(own_ttfts, own_tbts, slo, spec.level, spec.target_share, block))


def should_stop(f: Figures) -> bool:
    """Decided: the attainment is met or missed. The SLO is judged per request, each request's own TTFT and p99 gap,
    so the attainment says all there is; the pooled p99s are reported beside it."""
    return f.verdicts["attainment"] != "undecided"


# The futility rule's reading of the blocks still to come: the near end of this two-sided interval of the blocks so
# far (a moderately optimistic reading for each side).
OPTIMISTIC_LEVEL = 0.6


def reachable(wanted: Verdict, blocks: tuple[Block, ...], more: int, spec: MeasurementSpec) -> bool:
    """Whether ``more`` further blocks, each attaining at a moderately optimistic reading of the blocks so far (the
    near end of their :data:`OPTIMISTIC_LEVEL` interval), would bring the attainment to ``wanted``."""
    if not blocks or more <= 0:
        return False
    reading = attainment_interval(blocks, OPTIMISTIC_LEVEL)
    share = reading.high if wanted == "met" else reading.low
    size = max(1, round(sum(n for _, n in blocks) / len(blocks)))
    future = list(blocks) + [(round(share * size), size)] * more
    return lower_verdict(attainment_interval(future, spec.level, spec.target_share), spec.target_share) == wanted


def cannot_decide_by_cap(f: Figures, segments_done: int, cap_segments: int, spec: MeasurementSpec) -> bool:
    """Futility within a measurement: the attainment is undecided and neither "met" nor "missed" is within reach by
    the cap (its blocks projected from those so far; :func:`reachable`)."""
    if f.verdicts["attainment"] != "undecided" or segments_done >= cap_segments or not f.blocks:
        return False
    more = math.ceil(len(f.blocks) * cap_segments / segments_done) - len(f.blocks)
    return not reachable("met", f.blocks, more, spec) and not reachable("missed", f.blocks, more, spec)


@dataclass
class Measurement:
    """A config at a rate: the pooled figures of its segments and what they decide."""

    knobs: dict[str, Any]
    rate: float
    figures: Figures | None  # None when no segment measured anything
    segments: list[TrialOutcome] = field(default_factory=list)
    reason: str | None = None  # why the config failed here (then the measurement is "missed")
    void: str | None = None  # why the measuring machinery failed (then it is "undecided": no evidence)
    window_s: float = 0.0  # total measured window time
    stopped: str = ""  # why it stopped before the cap while undecided (the futility rule)

    @property
    def verdict(self) -> Verdict:
        """Whether the config serves this rate: its attainment's verdict against the target share."""
        if self.reason is not None:
            return "missed"
        if self.void is not None or self.figures is None:
            return "undecided"
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

    @property
    def other_cpu(self) -> float | None:
        """The most CPU (cores) other processes on this machine took during one of its windows (None: not known)."""
        values = [s.summary.get("host", {}).get("other_cores") for s in self.segments if s.summary]
        return max((v for v in values if v is not None), default=None)

    def describe(self) -> str:
        """``attainment 94% (88-98%) met, ... [112 req in 14 blocks of 8, 9k gaps, 45s]``."""
        if self.figures is None:
            return f"void: {self.void}" if self.void else f"failed: {self.reason}"
        f = self.figures
        v = f.verdicts
        text = (f"attainment {f.attainment.format('%', 100, 3)} {v['attainment']}"
                + (f", within TBT {f.tbt_attainment.format('%', 100, 3)}" if "tbt_p99" in v else "")
                + f", p99 TBT {f.tbt_p99.format('ms', 1000, 3)}" + (f" {v['tbt_p99']}" if "tbt_p99" in v else "")
                + f", p99 TTFT {f.ttft_p99.format('s', 1, 2)}" + (f" {v['ttft_p99']}" if "ttft_p99" in v else "")
                + f" [{f.requests} req in {len(f.blocks)} blocks of {f.block}, {f.gaps} gaps, {self.window_s:.0f}s")
        itl = self.engine_itl_p99
        if itl is not None:
            text += f"; engine-side p99 ITL <= {itl * 1000:.0f}ms"
        other = self.other_cpu
        if other is not None and other >= 0.05:
            text += f"; other processes took {other:.2f} cores"
        text += "]"
        return (text + (f"; {self.reason}" if self.reason else "") + (f"; void: {self.void}" if self.void else "")
                + (f"; {self.stopped}" if self.stopped else ""))

    def as_dict(self) -> dict[str, Any]:
        return {"knobs": self.knobs, "rate": self.rate, "verdict": self.verdict, "reason": self.reason,
                "void": self.void, "stopped": self.stopped, "window_s": self.window_s, "segments": len(self.segments),
                "output_tokens_per_s": self.output_tokens_per_s, "engine_itl_p99": self.engine_itl_p99,
                "other_cpu_cores": self.other_cpu, "figures": self.figures.as_dict() if self.figures else None,
                "dirs": [str(s.out_dir) for s in self.segments if s.out_dir]}


def window_records(outcome: TrialOutcome) -> list[RequestRecord]:
    """The records of a segment's measurement window, read back from its trial folder (both backends write one)."""
    if outcome.out_dir is None or not (Path(outcome.out_dir) / files.RECORDS).exists():
        return []
    window = (outcome.summary or {}).get("window")
    records = read_records(str(Path(outcome.out_dir) / files.RECORDS))
    if not window:
        return records
    a, b = float(window[0]), float(window[1])
    return [r for r in records if a <= r.scheduled_at < b]


def segment_seed(draw: int, segment: int) -> int:
    """The arrival seed of segment ``segment`` of draw ``draw``: every config measured on draw d sees the same
    arrivals (common random numbers), and no two segments repeat one."""
    return draw * 1000 + segment


@dataclass(frozen=True)
class Draws:
    """The arrival draws of one run, all from its seed, none shared with a run of another seed: the floor's, the
    searches' (probe i of every config's search on ``search + i``) and the verdict's (round r on ``verdict + r``)."""

    seed: int = 0

    @property
    def floor(self) -> int:
        return 100 * self.seed

    @property
    def search(self) -> int:
        return 100 * self.seed + 10

    @property
    def verdict(self) -> int:
        return 100 * self.seed + 60


def machinery_failure(outcome: TrialOutcome) -> bool:
    return bool(outcome.reason) and str(outcome.reason).startswith(MACHINERY_FAILURES)


def measure(backend: TrialBackend, knobs: dict[str, Any], rate: float, out_dir: Path, draw: int = 0,
            spec: MeasurementSpec = MeasurementSpec(),
            on_segment: Callable[[Measurement], None] | None = None) -> Measurement:
    """Measure ``knobs`` at ``rate`` segment by segment until :func:`should_stop`, the futility rule or the cap
    (sustained, ``spec.sustained_s`` > 0: in one contiguous window, judged at its end)."""
    m = Measurement(knobs=dict(knobs), rate=rate, figures=None)
    windows: list[list[RequestRecord]] = []
    cap = 1 if spec.sustained_s > 0 else spec.segments_at(rate)
    length = {"duration": spec.sustained_window_at(rate)} if spec.sustained_s > 0 else {}
    for i in range(cap):
        for attempt in range(1 + MACHINERY_RETRIES):  # the machinery's failure is no evidence: run it again
            folder = Path(out_dir) / (f"segment-{i}" + (f"-retry-{attempt}" if attempt else ""))
            o = backend.run(knobs, folder, rate=rate, seed=segment_seed(draw, i), **length)
            m.segments.append(o)
            if not machinery_failure(o):
                break
        m.knobs = dict(o.knobs)
        if machinery_failure(o):
            m.void = str(o.reason)
            return m
        if o.reason and o.reason.startswith(CONFIG_FAILURES):  # rejected, crashed: the config fails here
            m.reason = o.reason
            return m
        windows.append(window_records(o))
        m.window_s += float((o.summary or {}).get("duration_s") or 0.0)
        m.figures = figures(windows, backend.slo, spec, rate)
        if on_segment is not None:
            on_segment(m)
        if should_stop(m.figures):
            break
        if cannot_decide_by_cap(m.figures, i + 1, cap, spec):
            m.stopped = f"stopped after {i + 1} of {cap} windows: neither met nor missed is within reach by the cap"
            break
    return m
