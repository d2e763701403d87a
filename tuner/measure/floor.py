"""The machine's floor: what this machine can do at all with the load generator running, measured before a search.

Two short runs at a low load, each windows until their gaps can bound a p99: one request at a time
(``max_num_seqs`` 1) and a small batch (``max_num_seqs`` 4).
From them: the engine's decode-step p99 at batch 1 and at batch 2-4 (its own step records), the client-side p99 TBT
of the batch-1 trial with its order-statistic interval, the engine-side p99 inter-token latency beside it (the
difference is what the load generator and the host add), and the generator's own timing error (send lag p99).

Where the load generator shares the engine's cores, the batch-1 run is repeated under each arrangement of the two
(tuner/trials/arrangement.py) and the least disturbing one is kept for the whole run.

The batch-1 run also gives each request's time to first token from the moment a one-at-a-time engine takes it up
(its send, or the end of the request before it when that came later): its own prompt's prefill, without the queue.
With each request's own p99 gap, that is the SLO judged one request at a time, the best any config does with these
prompts here. When even one request at a time misses the TBT target beyond the noise (the pooled p99's interval
above it), or when the share of requests that attain one at a time is shown below the target share (its interval's
upper end below 90 %), no config can meet the SLO on this machine: tune says so, with the target that binds and the
targets this machine reaches one at a time, and stops before searching. Each of the two routes is judged at half the
error rate (97.5 % at the policy's 95 %), so that together they stop wrongly no more often than the level allows.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.records import RequestRecord, read_records
from loadtest.summary import request_tbt_p99
from slotune.slo import SLO
from slotune.units import format_duration
from tuner.trials.arrangement import Arrangement
from tuner.measure.measurement import CONFIG_FAILURES, MACHINERY_FAILURES, MeasurementSpec, figures, segment_seed, \
    window_records
from tuner.measure.targets import Reached, reached
from tuner.measure.dependence import attainment_interval, block_counts
from tuner.measure.statistics import Interval, bonferroni_level, lower_verdict, upper_verdict
from tuner.trials.trial_backend import TrialBackend
from tuner.trials.trial_runner import TrialOutcome
from slotune import result_files as files

BATCH_1 = {"max_num_seqs": 1}
CENSORED = ("unfinished", "not_sent")  # a request's status when the run ended before it did
SMALL_BATCH = {"max_num_seqs": 4}
FLOOR_RATE = 1.0  # req/s of the batch-1 windows, unless one request at a time does not keep up with it
# the batch-1 load keeps one sequence busy at most this share of the time: with long outputs one request at a time
# falls behind 1 req/s, and a window's requests would mostly wait, cut off by its end; near 1, so that a window
# still finishes about as many requests as a saturated engine would
KEEP_UP = 0.8


@dataclass
class Floor:
    tbt_p99_batch1: Interval  # client side, pooled gaps of the batch-1 trial
    engine_itl_p99_batch1: float | None  # engine side (its histogram's bucket bound)
    step_p99_batch1: float | None  # decode-only steps with one sequence
    step_p99_small_batch: float | None  # decode-only steps with 2-4 sequences
    send_lag_p99: float | None  # the load generator's own timing error
    reason: str | None = None  # why it could not be measured
    arrangement: str = ""  # where the load generator runs (tuner/trials/arrangement.py): the least disturbing one tried
    by_arrangement: dict[str, Any] = field(default_factory=dict)  # batch-1 p99 TBT interval per arrangement tried
    alone: OneAtATime | None = None  # the SLO judged one request at a time (batch 1, no queue)
    rate: float = FLOOR_RATE  # req/s of the pooled batch-1 windows (lower where one at a time did not keep up)

    def below(self, slo: SLO) -> bool:
        """No config can meet ``slo`` here, beyond the noise: the TBT target is below the pooled p99 gap one request at
        a time gets, or the share of requests that attain one at a time is shown below the target share."""
        if slo.tbt_p99 is not None and upper_verdict(self.tbt_p99_batch1, slo.tbt_p99) == "missed":
            return True
        return self.alone is not None and lower_verdict(self.alone.attainment,
                                                        self.alone.targets.target_share) == "missed"

    def why_below(self, slo: SLO) -> str:
        """What :meth:`below` found, in words: the target that binds and what one request at a time gets."""
        parts = []
        if slo.tbt_p99 is not None and upper_verdict(self.tbt_p99_batch1, slo.tbt_p99) == "missed":
            parts.append(f"p99 TBT <= {format_duration(slo.tbt_p99)} is below this machine's floor: one request at a "
                         f"time already gets p99 TBT {self.tbt_p99_batch1.format('ms', 1000)}")
        if self.alone is not None:
            parts.append(self.alone.describe())
        return "; ".join(parts)

    def describe(self) -> str:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1000:.1f}ms"

        return (f"batch-1 p99 TBT {self.tbt_p99_batch1.format('ms', 1000, 3)} client-side at {self.rate:.3g} req/s, "
                f"<= {ms(self.engine_itl_p99_batch1)} engine-side; decode-step p99 {ms(self.step_p99_batch1)} at "
                f"batch 1, {ms(self.step_p99_small_batch)} at batch 2-4; load generator send lag p99 "
                f"{ms(self.send_lag_p99)}" + (f"; {self.arrangement}" if self.arrangement else "")
                + ("" if len(self.by_arrangement) < 2 else " (batch-1 p99 TBT by arrangement: " + ", ".join(
                    f"{k} {_ms(v.get('value'))}" for k, v in self.by_arrangement.items()) + ")"))

    def as_dict(self) -> dict[str, Any]:
        return {"tbt_p99_batch1": self.tbt_p99_batch1.as_dict(), "engine_itl_p99_batch1": self.engine_itl_p99_batch1,
                "step_p99_batch1": self.step_p99_batch1, "step_p99_small_batch": self.step_p99_small_batch,
                "send_lag_p99": self.send_lag_p99, "reason": self.reason, "arrangement": self.arrangement,
                "by_arrangement": self.by_arrangement, "one_at_a_time": self.alone.as_dict() if self.alone else None,
                "rate": self.rate}


@dataclass(frozen=True)
class OneAtATime:
    """The SLO judged on the floor's batch-1 requests, each one's TTFT counted from when the engine took it up."""

    attainment: Interval  # the share attaining the SLO one at a time (on blocks, at the floor's level)
    targets: Reached  # each target on its own: which binds, and what 90 % of the requests reach one at a time

    def describe(self) -> str:
        share = f"{self.targets.target_share:.0%}"
        binds = self.targets.binds()
        text = (f"one request at a time, {self.attainment.format('%', 100, 3)} of the workload's requests attain "
                f"the SLO (the target is {share})")
        if binds:
            text += "; " + self.targets.binds_text()
        return (text + f"; the targets this machine reaches for {share} of the requests one at a time: TTFT "
                f"{self.targets.ttft.format('s', 1, 3)}, p99 TBT {self.targets.tbt.format('ms', 1000, 3)}")

    def as_dict(self) -> dict[str, Any]:
        return {"attainment": self.attainment.as_dict(), **self.targets.as_dict()}


def taken_up(records: list[RequestRecord]) -> list[tuple[RequestRecord, float]]:
    """Each request, in send order, with when a one-at-a-time engine (``max_num_seqs`` 1 serves in arrival order)
    took it up: its send, or the end of the request before it when that came later (a request never answered frees
    the engine at once: the one after it is counted from its own send)."""
    out = []
    free_at = -math.inf
    for r in sorted(records, key=lambda r: r.intended_send_time):
        out.append((r, max(r.intended_send_time, free_at)))
        free_at = r.finish_time if math.isfinite(r.finish_time) else -math.inf
    return out


def own_ttfts(records: list[RequestRecord]) -> dict[int, float]:
    """Each request's time to first token from when a one-at-a-time engine took it up (:func:`taken_up`); a request
    never answered gets inf."""
    return {r.index: r.intended_send_time + r.ttft - start
            if r.status == "ok" and math.isfinite(r.intended_send_time + r.ttft) else math.inf
            for r, start in taken_up(records)}


def load_test_records(outcome: TrialOutcome) -> list[RequestRecord]:
    """Every request of a window's load test, its warm-up's included ([] without a records file)."""
    path = Path(outcome.out_dir) / files.RECORDS if outcome.out_dir is not None else None
    return read_records(str(path)) if path is not None and path.exists() else []


def keep_up_rate(records: list[RequestRecord]) -> float | None:
    """The rate at which one request at a time keeps the engine busy KEEP_UP of the time: KEEP_UP over the requests'
    mean time in service, from when the engine took each up to its finish (None: none finished)."""
    service = [r.finish_time - start for r, start in taken_up(records)
               if r.status == "ok" and math.isfinite(r.finish_time) and r.finish_time > start]
    return KEEP_UP / float(np.mean(service)) if service else None


def one_at_a_time(outcomes: list[TrialOutcome], slo: SLO, spec: MeasurementSpec, rate: float) -> OneAtATime | None:
    """The SLO judged on the windows of batch-1 ``outcomes``, each request's TTFT its own (:func:`own_ttfts`, over the
    whole load test so that a window's first request knows the warm-up's last); None when nothing was measured."""
    ttfts: list[list[float]] = []
    tbts: list[list[float]] = []
    for o in outcomes:
        if not (everything := load_test_records(o)):
            continue
        own = own_ttfts(everything)
        # a request the run's end cut off (still queued or streaming, or never sent) is censored, not a miss: on a
        # slow engine one at a time falls behind even a low rate, and the window's last requests wait their turn
        window = sorted((r for r in window_records(o) if r.status not in CENSORED), key=lambda r: r.scheduled_at)
        if window:
            ttfts.append([own.get(r.index, math.inf) for r in window])
            tbts.append([request_tbt_p99(r) if r.status == "ok" else math.inf for r in window])
    if not ttfts:
        return None
    block = spec.block_at(rate)
    targets = reached(ttfts, tbts, slo, spec.level, spec.target_share, block)
    attaining = [[(slo.ttft_p99 is None or t <= slo.ttft_p99) and (slo.tbt_p99 is None or g <= slo.tbt_p99)
                  for t, g in zip(tw, gw)] for tw, gw in zip(ttfts, tbts)]
    blocks = [b for w in attaining for b in block_counts(w, block)]
    return OneAtATime(attainment_interval(blocks, spec.level, spec.target_share), targets)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}ms"


def _decode_step_p99(outcomes: list[TrialOutcome], low: int, high: int) -> float | None:
    steps: list[dict[str, Any]] = []
    for o in outcomes:
        path = Path(o.out_dir) / files.STEPS if o.out_dir is not None else None
        if path is not None and path.exists():
            steps += [json.loads(line) for line in path.read_text().splitlines() if line]
    d = [s["total_s"] for s in steps if s.get("num_prefill_tokens", 0) == 0 and low <= s["num_decode_tokens"] <= high]
    return float(np.percentile(d, 99)) if d else None


def _pooled_trial(backend: TrialBackend, knobs: dict[str, Any], out_dir: Path, rate: float,
                  spec: MeasurementSpec, draw: int, adapt: bool = False) -> Pooled:
    """Windows of ``knobs`` at ``rate`` until their pooled gaps can bound a p99 (``spec.min_gaps``), or the cap. With
    ``adapt``, a first window whose requests one at a time do not keep up with ``rate`` (:func:`keep_up_rate`) is a
    probe: its steps are kept, its requests are not pooled, and the windows after it run at the rate they keep up
    with."""
    pooled = Pooled(rate)
    for i in range(spec.max_segments):
        o = backend.run(dict(knobs), Path(out_dir) / f"window-{i}", rate=pooled.rate, seed=segment_seed(draw, i))
        pooled.outcomes.append(o)
        if o.reason and o.reason.startswith(CONFIG_FAILURES + MACHINERY_FAILURES):
            break
        records = window_records(o)
        # over the whole load test, so that the window's first request knows the warm-up's last
        slower = keep_up_rate(load_test_records(o)) if adapt and i == 0 else None
        if slower is not None and slower < pooled.rate:
            pooled.probes.append(o)
            pooled.rate = slower
            continue
        pooled.windows.append(records)
        if sum(max(0, len(r.token_times) - 1) for w in pooled.windows for r in w) >= spec.min_gaps:
            break
    return pooled


@dataclass
class Pooled:
    """A pooled trial: the rate its pooled windows ran at, their outcomes and records, and a probe window's."""

    rate: float
    outcomes: list[TrialOutcome] = field(default_factory=list)  # every window's, the probe's included
    windows: list[list[RequestRecord]] = field(default_factory=list)  # the pooled windows' records
    probes: list[TrialOutcome] = field(default_factory=list)

    @property
    def judged(self) -> list[TrialOutcome]:
        return [o for o in self.outcomes if o not in self.probes]


def measure_floor(backend: TrialBackend, out_dir: Path, rate: float = FLOOR_RATE, spec: MeasurementSpec | None = None,
                  arrangements: list[Arrangement] | None = None,
                  arrange: Callable[[Arrangement], None] | None = None, draw: int = 0
                  ) -> tuple[Floor, list[TrialOutcome]]:
    """The floor from batch-1 windows at ``rate``, or at the lower rate one request at a time keeps up with, under
    each of ``arrangements`` (applied by ``arrange``; the one whose client-side p99 TBT is lowest beyond the noise is
    kept and left applied), then small-batch windows at twice that rate."""
    spec = spec or MeasurementSpec()
    tried: list[Tried] = []
    options: list[Arrangement | None] = list(arrangements) if arrangements else [None]
    for a in options:
        if a is not None and arrange is not None:
            arrange(a)
        folder = Path(out_dir) / ("batch-1" if a is None else f"batch-1-{a.name}")
        pooled = _pooled_trial(backend, BATCH_1, folder, rate, spec, draw, adapt=True)
        rate = pooled.rate  # the next arrangements start where one request at a time kept up
        tried.append((a, pooled))
    by_arrangement = {a.name: figures(p.windows, backend.slo, spec, p.rate).tbt_p99.as_dict() for a, p in tried
                      if a is not None}
    chosen, one = least_disturbing(tried, backend.slo, spec)
    if chosen is not None and arrange is not None:
        arrange(chosen)
    small = _pooled_trial(backend, SMALL_BATCH, Path(out_dir) / "batch-4", 2 * one.rate, spec, draw)
    # two routes to "no config can meet the SLO here" (the pooled p99 TBT, the share attaining one at a time): each
    # judged at half the error rate, so that the stop is wrong no more often than the spec's level allows
    stop = replace(spec, level=bonferroni_level(spec.level, 2))
    f = figures(one.windows, backend.slo, stop, one.rate)
    summaries = [o.summary for o in one.judged if o.summary]
    lags = [s["send_lag_p99"] for s in summaries if s.get("send_lag_p99") is not None]
    itl = [s["engine_itl_p99"] for s in summaries if s.get("engine_itl_p99") is not None]
    reason = None if any(s.get("completed") for s in summaries) else \
        (one.outcomes[-1].reason or "no request completed")
    floor = Floor(f.tbt_p99, max(itl) if itl else None, _decode_step_p99(one.outcomes, 1, 1),
                  _decode_step_p99(small.outcomes, 2, 4), max(lags) if lags else None, reason,
                  chosen.describe() if chosen is not None else "", by_arrangement,
                  one_at_a_time(one.judged, backend.slo, stop, one.rate), rate=one.rate)
    (Path(out_dir) / "floor.json").write_text(json.dumps(floor.as_dict(), indent=1) + "\n")
    return floor, [o for _, p in tried for o in p.outcomes] + small.outcomes


Tried = tuple[Arrangement | None, Pooled]


def least_disturbing(tried: list[Tried], slo: Any, spec: MeasurementSpec) -> Tried:
    """The first arrangement (the default) unless another's batch-1 p99 TBT is lower beyond the noise (its interval
    entirely below the first one's); among several such, the lowest. An arrangement whose windows measured nothing
    (their machinery failed: a busy machine) is passed over."""
    measured = [t for t in tried if any(t[1].windows)] or tried[:1]
    p99 = [figures(p.windows, slo, spec, p.rate).tbt_p99 for _, p in measured]
    better = [i for i in range(1, len(measured)) if p99[i].high < p99[0].low]
    return measured[min(better, key=lambda i: p99[i].value)] if better else measured[0]
