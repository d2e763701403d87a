"""The measurement's stopping rule and the capacity search, on scripted trials with known
answers (no engine: each scripted trial writes a real trial folder of records that the measurement reads back)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadtest.records import RequestRecord, write_records
from slotune.slo import SLO
from loadtest.summary import summarize
from tuner.measure.capacity import CapacitySearcher, knob_distance, next_rate, search_capacity, start_from_known
from tuner.measure.measurement import Figures, Measurement, MeasurementSpec, figures, measure
from tuner.measure.statistics import Interval, Verdict
from tuner.trials.trial_runner import TrialOutcome

SLO_50MS = SLO(tbt_p99=0.050, ttft_p99=2.0)


@dataclass
class ScriptedBackend:
    """Each trial: ``requests`` requests of 20 tokens; a share ``bad`` of them stutter (100 ms gaps, so they do not
    attain), the others keep 10-30 ms gaps."""

    bad: float
    requests: int = 40
    slo: SLO = SLO_50MS
    simulated: bool = True
    calls: list[int] = field(default_factory=list)

    def run(self, knobs: dict[str, Any], out_dir: Path, rate: float | None = None,
            seed: int | None = None) -> TrialOutcome:
        rng = np.random.default_rng(seed)
        self.calls.append(int(seed or 0))
        recs = []
        for i in range(self.requests):
            at = i * 0.5
            stutter = rng.random() < self.bad
            gaps = np.full(19, 0.100) if stutter else rng.uniform(0.010, 0.030, 19)
            first = at + 0.2
            times = list(first + np.concatenate([[0.0], np.cumsum(gaps)]))
            recs.append(RequestRecord(index=i, scheduled_at=at, intended_send_time=at, actual_send_time=at,
                                      output_tokens=20, ttft=0.2, token_times=times, finish_time=times[-1]))
        return scripted_trial(recs, knobs, out_dir, rate, self.slo, window=(0.0, self.requests * 0.5))


def scripted_trial(recs: list[RequestRecord], knobs: dict[str, Any], out_dir: Path, rate: float | None, slo: SLO,
                   window: tuple[float, float]) -> TrialOutcome:
    """A scripted trial's folder (its records) and outcome (their summary over ``window``), as a backend writes."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_records(str(Path(out_dir) / "records.parquet"), recs)
    summary = summarize(recs, slo, window=window)
    return TrialOutcome(dict(knobs), summary, {}, True, None, Path(out_dir), simulated=True, rate=rate)


def run_measurement(bad: float, tmp_path: Path, segments: int = 4, block_s: float = 4.0
                    ) -> tuple[Measurement, ScriptedBackend]:
    backend = ScriptedBackend(bad)
    m = measure(backend, {"max_num_seqs": 4}, 2.0, tmp_path, draw=3,
                spec=MeasurementSpec(max_segments=segments, block_s=block_s))
    return m, backend


def test_a_clear_miss_stops_after_one_window(tmp_path: Path) -> None:
    missed, backend = run_measurement(0.5, tmp_path / "missed")
    assert missed.verdict == "missed" and len(missed.segments) == 1 and backend.calls == [3000]


def test_a_served_rate_is_shown_served_once_its_windows_hold_enough_blocks(tmp_path: Path) -> None:
    """Every request attains. 40 requests at 2 req/s in blocks of 4 s (8 requests) are 5 blocks a window: the
    measurement cannot show 90 % in the 4 windows of its cap and gives up after the first (nothing within reach,
    never "met" on independent-looking requests); in blocks of 1.5 s (3 requests) 13 blocks a window show it
    within the cap, a fresh arrival draw each window."""
    coarse, _ = run_measurement(0.0, tmp_path / "coarse")
    assert coarse.verdict == "undecided" and len(coarse.segments) == 1 and "within reach" in coarse.stopped
    assert coarse.figures is not None and coarse.figures.block == 8 and len(coarse.figures.blocks) == 5
    fine, backend = run_measurement(0.0, tmp_path / "fine", segments=6, block_s=1.5)
    assert fine.verdict == "met" and 1 < len(fine.segments) <= 6 and backend.calls[:2] == [3000, 3001]
    assert fine.figures is not None and fine.figures.attainment.low >= 0.9
    assert fine.figures.verdicts["tbt_p99"] == "met" and fine.figures.tbt_attainment.value == 1.0


def test_an_attainment_at_the_edge_stops_undecided_once_neither_verdict_is_within_reach(tmp_path: Path) -> None:
    # 10 % stutter: attainment ~90 %, right at the target share: the measurement gives up early, as undecided
    # (never met or missed), and says why
    m, _ = run_measurement(0.1, tmp_path, segments=8, block_s=1.5)
    assert 1 <= len(m.segments) < 8
    assert m.figures is not None and m.figures.attainment.low < 0.9 < m.figures.attainment.high
    assert m.verdict == "undecided" and "undecided" in m.describe() and "within reach" in m.stopped


def test_the_futility_rule_gives_up_only_where_the_cap_could_not_decide() -> None:
    from tuner.measure.measurement import cannot_decide_by_cap

    spec = MeasurementSpec(block_s=1.0)

    def f(attaining: int, n: int) -> Figures:
        recs = [RequestRecord(index=i, ttft=0.1, token_times=[i + 0.1 + 0.01 * k for k in range(20)],
                              scheduled_at=float(i), intended_send_time=float(i)) for i in range(n)]
        for i in set(np.round(np.linspace(0, n - 1, n - attaining)).astype(int)) if n > attaining else set():
            recs[i].status = "error"  # the misses spread over the window
        return figures([recs], SLO_50MS, spec, rate=1.0)  # blocks of 3 requests

    assert cannot_decide_by_cap(f(27, 30), 1, 2, spec)  # 90 % of 10 blocks, 20 at the cap: neither is in reach
    assert not cannot_decide_by_cap(f(30, 30), 1, 8, spec)  # all attained, 80 blocks at the cap can show it
    assert not cannot_decide_by_cap(f(22, 30), 1, 8, spec)  # 73 %: a miss is within reach
    assert not cannot_decide_by_cap(f(10, 30), 1, 8, spec)  # missed already decides; not the futility rule's case
    assert not cannot_decide_by_cap(f(27, 30), 8, 8, spec)  # at the cap there is nothing left to give up


def test_a_p99_from_too_few_gaps_is_never_decided() -> None:
    recs = [RequestRecord(index=i, ttft=0.1, token_times=[0.1, 0.11, 0.12]) for i in range(60)]
    f = figures([recs], SLO_50MS, MeasurementSpec(min_gaps=400))
    assert f.gaps == 120 and f.verdicts["tbt_p99"] == "undecided"
    unfinished = [RequestRecord(index=i, status="unfinished") for i in range(5)]
    g = figures([recs + unfinished], SLO_50MS)
    assert g.attaining == 60 and g.ttft_p99.high == math.inf  # no first token: an infinite TTFT


def test_blocks_never_span_two_windows_and_pair_across_window_lengths() -> None:
    one = [RequestRecord(index=i, ttft=0.1, token_times=[0.1, 0.11], scheduled_at=i / 2) for i in range(11)]
    f = figures([one, one[:7]], SLO_50MS, MeasurementSpec(block_s=2.0), rate=2.0)  # blocks of 4 requests
    assert f.blocks == ((4, 4), (7, 7), (7, 7)) and f.block == 4
    from tuner.measure.dependence import block_counts
    long, short = block_counts([True] * 23, 4), block_counts([True] * 13, 4)
    assert long[:2] == short[:2]  # the same arrivals cut alike, however long each window ran


def scripted_measurement(rate: float, verdict: Verdict, point: float | None = None) -> Measurement:
    """A measurement that decided ``verdict`` with attainment ``point`` (default: 0.97 met, 0.5 missed, 0.9
    undecided)."""
    share = point if point is not None else {"met": 0.97, "missed": 0.5, "undecided": 0.9}[verdict]
    iv = Interval(share, share - 0.05, min(1.0, share + 0.05), 0.95, 50)
    f = Figures(50, int(50 * share), 1000, iv, iv, iv, iv, {"attainment": verdict})
    return Measurement({"max_num_seqs": 4}, rate, f)


def truth(capacity: float, edge: float = 0.04) -> Any:
    """Shown met well below ``capacity``, missed well above, undecided near it (reading 92 % below, 88 % above)."""
    def probe(rate: float) -> Measurement:
        if rate <= capacity * (1 - edge):
            return scripted_measurement(rate, "met")
        if rate >= capacity * (1 + edge):
            return scripted_measurement(rate, "missed")
        return scripted_measurement(rate, "undecided", 0.92 if rate <= capacity else 0.88)
    return probe


@pytest.mark.parametrize("capacity", [0.3, 1.0, 3.7, 11.0])
def test_the_rate_search_brackets_the_capacity_up_or_down_to_its_resolution(capacity: float) -> None:
    cap = search_capacity(truth(capacity), {"max_num_seqs": 4}, start=1.0, resolution=0.15, max_probes=12)
    assert cap.resolved, cap.as_dict()
    assert cap.low <= capacity * 1.04 and capacity * 0.96 <= cap.high
    assert cap.high / cap.low <= 1.15 + 1e-9
    # the shown bracket holds only the decided probes: it contains the searched one
    assert cap.shown.low <= cap.low and cap.shown.high >= cap.high and cap.shown.level == 0.95


def test_undecided_probes_steer_the_search_but_bound_nothing() -> None:
    """Every probe undecided (too few blocks to show anything), reading 95 % below 2 req/s and 85 % above: the search
    brackets 2 req/s by what it read, and shows nothing at any level: both ends of the shown bracket stay open."""
    def probe(rate: float) -> Measurement:
        return scripted_measurement(rate, "undecided", 0.95 if rate < 2.0 else 0.85)

    cap = search_capacity(probe, {}, start=1.0, max_probes=10)
    assert cap.resolved and cap.low < 2.0 <= cap.high
    assert (cap.shown.low, cap.shown.high) == (0.0, math.inf) and "served no rate, missed no rate" in cap.describe()


def test_contradictory_probes_widen_the_shown_bracket_and_are_reported() -> None:
    """A rate shown missed below one shown served: the bracket covers both (no rate is invented between them)."""
    from tuner.measure.capacity import Shown

    s = Shown.of([(2.0, "met"), (4.0, "met"), (3.0, "missed"), (6.0, "missed"), (5.0, "undecided")], 0.95)
    assert (s.low, s.high) == (2.0, 6.0) and s.contradictions == ((4.0, 3.0),)
    assert "contradictory: served 4 but missed 3" in s.format()
    assert Shown.of([(1.0, "missed"), (0.5, "undecided")], 0.95).as_list() == [0.0, 1.0]


def test_a_config_that_serves_nothing_has_capacity_zero_and_a_rejected_one_stops_at_once() -> None:
    cap = search_capacity(truth(0.001), {}, start=1.0, max_probes=20)
    assert not cap.feasible and cap.value == 0.0 and "lowest rate" in cap.stopped
    rejected = Measurement({}, 1.0, None, reason="rejected by the engine: chunk_size > max_num_batched_tokens")
    cap2 = search_capacity(lambda r: rejected, {}, start=1.0, max_probes=6)
    assert len(cap2.probes) == 1 and cap2.rejected


def test_a_search_past_its_deadline_starts_no_further_probe_and_keeps_its_bracket(tmp_path: Path) -> None:
    """The searches' deadline leaves the verdict its rounds: a search that started in time stops probing at it
    (its first probe always runs) and keeps what it found."""
    probed: list[float] = []

    def probe(rate: float) -> Measurement:
        probed.append(rate)
        return truth(3.0)(rate)

    cap = search_capacity(probe, {}, start=1.0, resolution=0.15, max_probes=8,
                          time_up=lambda: "time is up" if len(probed) >= 3 else None)
    assert probed == [1.0, 2.0, 4.0] and (cap.low, cap.high) == (2.0, 4.0) and cap.stopped == "time is up"
    assert not cap.resolved and cap.feasible
    searcher = CapacitySearcher(ScriptedBackend(0.0), MeasurementSpec(max_segments=1), ["max_num_seqs"],
                                deadline=time.monotonic() - 1)
    late = searcher.search({"max_num_seqs": 4}, tmp_path)
    assert len(late.probes) == 1 and "time is up" in late.stopped


def test_known_neighbours_start_the_search_near_their_capacity() -> None:
    names = ["max_num_seqs", "chunk_size"]
    known = [({"max_num_seqs": 4, "chunk_size": 16}, 2.0, 2.2), ({"max_num_seqs": 64, "chunk_size": 16}, 0.5, 0.6)]
    assert start_from_known({"max_num_seqs": 8, "chunk_size": 16}, known, names, 1.0) == (2.0, 1.5)
    # a neighbour that served nothing: start at its lowest rate not served, where this config may do better
    assert start_from_known({"max_num_seqs": 8}, [({"max_num_seqs": 8}, 0.0, 0.5)], names, 1.0) == (0.5, 1.5)
    assert start_from_known({"max_num_seqs": 8}, [], names, 1.0) == (1.0, 2.0)
    assert knob_distance({"max_num_seqs": 4}, {"max_num_seqs": 16}, ["max_num_seqs"]) == 2.0
    cap = search_capacity(truth(2.1), {}, start=2.0, step=1.5, resolution=0.15, max_probes=8)
    assert cap.resolved and len(cap.probes) <= 4
    assert next_rate(0.0, math.inf, 1.0, 2.0) == 1.0 and next_rate(1.0, 4.0, 1.0, 2.0) == 2.0


def test_the_target_that_ends_a_capacity_is_the_one_missed_at_the_lowest_rate_not_served() -> None:
    iv = Interval(0.5, 0.4, 0.6, 0.95, 50)

    def probe_missing(*missed: str) -> Any:
        def probe(rate: float) -> Measurement:
            if rate <= 2.0:
                return scripted_measurement(rate, "met")
            verdicts: dict[str, Verdict] = {"attainment": "missed", "tbt_p99": "met", "ttft_p99": "met"}
            verdicts.update({k: "missed" for k in missed})
            return Measurement({}, rate, Figures(50, 20, 1000, iv, iv, iv, iv, verdicts))
        return probe

    for missed, bound in [(("ttft_p99",), "ttft"), (("tbt_p99",), "tbt"), (("tbt_p99", "ttft_p99"), ""), ((), "")]:
        cap = search_capacity(probe_missing(*missed), {}, start=1.0, resolution=0.15, max_probes=12)
        assert cap.resolved and cap.bound == bound and cap.as_dict()["bound"] == bound
    assert search_capacity(truth(11.0), {}, start=1.0, max_probes=2).bound == ""  # nothing missed yet


def test_on_the_simulator_the_capacity_bracket_separates_served_from_not_served_rates(tmp_path: Path) -> None:
    from policies import WorkloadSpec
    from tuner.simulation.profiles import limits_of, profile_path
    from tuner.simulation.simulator_trial import SimTrialRunner
    from tuner.simulation.step_time_model import StepTimeModel

    model = StepTimeModel.load(profile_path(None))
    sim = SimTrialRunner(model, limits=limits_of(model), workload=WorkloadSpec("mixed", 0.125, output_scale=1.0),
                         duration=15.0, warmup=3.0, slo=SLO_50MS)
    spec = MeasurementSpec(max_segments=3, window_s=15.0)
    knobs = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "chunk_size": 16}

    def probe(rate: float) -> Measurement:
        return measure(sim, knobs, rate, tmp_path / f"{rate:.4f}", 0, spec)

    cap = search_capacity(probe, knobs, start=1.0, resolution=0.15, max_probes=8)
    assert cap.feasible and math.isfinite(cap.high) and cap.high > cap.low
    read = {m.rate: m.figures.attainment.value for m in cap.probes if m.figures is not None}
    assert all(v >= 0.9 for r, v in read.items() if r <= cap.low)
    assert all(v < 0.9 for r, v in read.items() if r >= cap.high)
    # what is shown lies outside the searched bracket's ends, never inside it
    assert cap.shown.low <= cap.low and cap.shown.high >= cap.high
    at = cap.at_capacity
    assert at is not None and at.rate == cap.low
    # common random numbers: two configs on one draw see the same arrivals
    a = measure(sim, knobs, 1.0, tmp_path / "a", 7, MeasurementSpec(max_segments=1))
    b = measure(sim, {"max_num_seqs": 2}, 1.0, tmp_path / "b", 7, MeasurementSpec(max_segments=1))
    from tuner.measure.measurement import window_records
    sent_a = [r.intended_send_time - window_records(a.segments[0])[0].intended_send_time
              for r in window_records(a.segments[0])]
    sent_b = [r.intended_send_time - window_records(b.segments[0])[0].intended_send_time
              for r in window_records(b.segments[0])]
    assert sent_a == pytest.approx(sent_b)


@dataclass
class QueueBackend:
    """One server, first come first served, each request holding it ``service_s`` (10 tokens, 20 ms apart after a
    70 ms first token), arrivals evenly spaced at the offered rate from an idle start: above 1 / service_s the queue,
    and every later request's TTFT, grows for as long as the load lasts."""

    service_s: float = 0.25
    warmup: float = 3.0
    duration: float = 15.0
    slo: SLO = SLO_50MS
    simulated: bool = True

    def run(self, knobs: dict[str, Any], out_dir: Path, rate: float | None = None, seed: int | None = None,
            duration: float | None = None) -> TrialOutcome:
        assert rate is not None
        length = self.warmup + (duration or self.duration)
        recs, free = [], 0.0
        for i in range(int(length * rate)):
            at = i / rate
            start = max(at, free)
            free = start + self.service_s
            times = list(start + 0.07 + 0.02 * np.arange(10))
            recs.append(RequestRecord(index=i, scheduled_at=at, intended_send_time=at, actual_send_time=at,
                                      output_tokens=10, ttft=times[0] - at, token_times=times, finish_time=free))
        return scripted_trial(recs, knobs, out_dir, rate, self.slo, window=(self.warmup, length))


def test_a_sustained_window_does_not_show_served_a_rate_whose_queue_grows_slower_than_a_window(
        tmp_path: Path) -> None:
    """4.4 req/s against a server of 4 req/s: each window from an idle start ends with 1.8 s of queue, under the
    2 s TTFT bound, so windows in turn read every request served; one sustained minute of it leaves most requests
    queued for longer than 2 s."""
    spec = MeasurementSpec(max_segments=3, window_s=15.0, block_s=1.0)
    windows = measure(QueueBackend(), {}, 4.4, tmp_path / "windows", 0, spec)
    sustained = measure(QueueBackend(), {}, 4.4, tmp_path / "sustained", 0, replace(spec, sustained_s=60.0))
    assert windows.figures is not None and windows.figures.attainment.value == 1.0 and windows.verdict != "missed"
    assert sustained.verdict == "missed" and len(sustained.segments) == 1 and sustained.window_s == 60.0
    assert sustained.figures is not None and sustained.figures.attainment.value < 0.5
    # below the server's rate nothing queues: a sustained minute shows it served
    steady = measure(QueueBackend(), {}, 3.6, tmp_path / "steady", 0, replace(spec, sustained_s=60.0))
    assert steady.verdict == "met" and steady.window_s == 60.0


@dataclass
class FlakyBackend(ScriptedBackend):
    """Its first ``fail`` trials fail with ``reason`` (a machinery failure, or the config's), then as scripted."""

    fail: int = 1
    reason: str = "load test failed: locust exited with 1"

    def run(self, knobs: dict[str, Any], out_dir: Path, rate: float | None = None,
            seed: int | None = None) -> TrialOutcome:
        if self.fail > 0:
            self.fail -= 1
            self.calls.append(int(seed or 0))
            return TrialOutcome(dict(knobs), {}, {}, False, self.reason, Path(out_dir), rate=rate)
        return super().run(knobs, out_dir, rate, seed)


def test_a_failure_of_the_measuring_machinery_is_run_again_and_never_counts_as_a_miss(tmp_path: Path) -> None:
    spec = MeasurementSpec(max_segments=1)
    once = FlakyBackend(0.5, fail=1)
    m = measure(once, {}, 2.0, tmp_path / "once", 0, spec)
    assert m.verdict == "missed" and m.void is None and once.calls == [0, 0]  # the same window again
    twice = FlakyBackend(0.0, fail=2, reason="the machine was busy: other processes took 0.9 cores")
    v = measure(twice, {}, 2.0, tmp_path / "twice", 0, spec)
    assert v.verdict == "undecided" and v.void is not None and v.void.startswith("the machine was busy")
    assert "void: the machine was busy" in v.describe()
    rejected = FlakyBackend(0.0, fail=1, reason="rejected by the engine: 422")
    r = measure(rejected, {}, 2.0, tmp_path / "rejected", 0, spec)
    assert r.verdict == "missed" and r.reason is not None and len(r.segments) == 1  # the config's own failure


def test_a_requests_own_ttft_one_at_a_time_is_counted_from_when_the_engine_took_it_up() -> None:
    """At batch 1 a request waits for the one before it: its own time to first token starts at that one's end."""
    from loadtest.records import RequestRecord
    from tuner.measure.floor import own_ttfts

    a = RequestRecord(0, intended_send_time=100.0, ttft=0.5, finish_time=102.0)
    b = RequestRecord(1, intended_send_time=101.0, ttft=1.3, finish_time=103.0)  # waited 1 s behind a
    c = RequestRecord(2, intended_send_time=110.0, ttft=0.2, finish_time=111.0)  # arrived to an idle engine
    lost = RequestRecord(3, intended_send_time=111.5, status="unfinished")
    d = RequestRecord(4, intended_send_time=112.0, ttft=0.4, finish_time=113.0)
    own = own_ttfts([d, c, b, a, lost])
    assert own[0] == pytest.approx(0.5) and own[1] == pytest.approx(0.3) and own[2] == pytest.approx(0.2)
    assert own[3] == math.inf and own[4] == pytest.approx(0.4)


def test_one_at_a_time_counts_no_request_the_runs_end_cut_off(tmp_path: Path) -> None:
    """A slow engine at batch 1 falls behind the floor's rate: the window's last requests are still queued when the
    run ends. They are censored, not misses; the requests that were served judge the SLO one at a time."""
    from tuner.measure.floor import one_at_a_time

    served = [RequestRecord(i, scheduled_at=10.0 + i, intended_send_time=100.0 + 3 * i, ttft=0.2, output_tokens=3,
                            token_times=[100.2 + 3 * i, 100.25 + 3 * i, 100.3 + 3 * i], finish_time=100.3 + 3 * i)
              for i in range(9)]
    queued = [RequestRecord(9 + i, scheduled_at=19.0 + i, intended_send_time=127.0 + i, status="unfinished")
              for i in range(3)]
    write_records(str(tmp_path / "records.parquet"), served + queued)
    outcome = TrialOutcome({}, {"window": [0.0, 40.0]}, {}, True, None, tmp_path)
    alone = one_at_a_time([outcome], SLO(tbt_p99=0.1, ttft_p99=1.0), MeasurementSpec(), rate=1.0)
    assert alone is not None and alone.attainment.n == 9 and alone.attainment.value == 1.0
    assert alone.targets.ttft.value == pytest.approx(0.2) and alone.targets.binds() == []
    tight = one_at_a_time([outcome], SLO(tbt_p99=0.1, ttft_p99=0.1), MeasurementSpec(), rate=1.0)
    assert tight is not None and tight.attainment.value == 0.0 and tight.targets.binds() == ["ttft"]


def test_the_floor_keeps_the_least_disturbing_arrangement_and_flags_an_slo_below_it(tmp_path: Path) -> None:
    from tuner.trials.arrangement import NORMAL, REALTIME, SEPARATE, Arrangement
    from tuner.measure.floor import measure_floor

    @dataclass
    class Disturbed(ScriptedBackend):
        """Gaps of 10-30 ms plus what the arrangement adds (here: real-time priority adds most)."""

        added: float = 0.0

        def run(self, knobs: dict[str, Any], out_dir: Path, rate: float | None = None,
                seed: int | None = None) -> TrialOutcome:
            o = super().run(knobs, out_dir, rate, seed)
            from loadtest.records import read_records
            recs = read_records(str(Path(out_dir) / "records.parquet"))
            for r in recs:  # stretch every gap by the arrangement's disturbance
                t0 = r.token_times[0]
                r.token_times = [t0 + (t - t0) + i * self.added for i, t in enumerate(r.token_times)]
            write_records(str(Path(out_dir) / "records.parquet"), recs)
            return o

    backend = Disturbed(0.0)
    added = {"realtime": 0.030, "normal": 0.010, "separate": 0.002}

    def arrange(a: Arrangement) -> None:
        backend.added = added[a.name]

    floor, _ = measure_floor(backend, tmp_path, spec=MeasurementSpec(min_gaps=400, max_segments=2),
                             arrangements=[REALTIME, NORMAL, SEPARATE], arrange=arrange)
    assert floor.arrangement == SEPARATE.describe() and backend.added == 0.002  # kept applied
    assert set(floor.by_arrangement) == {"realtime", "normal", "separate"}
    assert floor.tbt_p99_batch1.value == pytest.approx(0.032, abs=0.002)
    assert not floor.below(SLO(tbt_p99=0.050)) and floor.below(SLO(tbt_p99=0.020))
    assert "separate" in floor.describe() or "core of its own" in floor.describe()
    assert (tmp_path / "floor.json").exists()
    # arrangements within the noise of each other: the first (the default) is kept
    added.update(realtime=0.002, normal=0.0021, separate=0.0019)
    again, _ = measure_floor(backend, tmp_path / "again", spec=MeasurementSpec(min_gaps=400, max_segments=2),
                             arrangements=[REALTIME, NORMAL, SEPARATE], arrange=arrange)
    assert again.arrangement == REALTIME.describe() and backend.added == 0.002
    # the first arrangement's window void (a busy machine): the floor is the one that measured, not "?"
    busy = {"on": False}

    @dataclass
    class BusyAtFirst(Disturbed):
        def run(self, knobs: dict[str, Any], out_dir: Path, rate: float | None = None,
                seed: int | None = None) -> TrialOutcome:
            if busy["on"]:
                return TrialOutcome(dict(knobs), {}, {}, False, "the machine was busy: other processes took 0.33 "
                                    "cores", Path(out_dir), rate=rate)
            return super().run(knobs, out_dir, rate, seed)

    flaky = BusyAtFirst(0.0)

    def arrange_busy(a: Arrangement) -> None:
        busy["on"] = a is REALTIME
        flaky.added = 0.01

    third, _ = measure_floor(flaky, tmp_path / "busy", spec=MeasurementSpec(min_gaps=400, max_segments=2),
                             arrangements=[REALTIME, NORMAL], arrange=arrange_busy)
    assert third.arrangement == NORMAL.describe() and third.tbt_p99_batch1.n > 0


def test_misses_in_one_run_carry_less_evidence_than_misses_spread_out() -> None:
    """135 requests, 5 misses: spread one per block they leave every block near 93 %; in one run they sink a block.
    The blocks say so; the requests' count alone could not."""
    from tuner.measure.dependence import attainment_interval, block_counts

    spread = np.ones(135, dtype=bool)
    spread[[5, 32, 59, 86, 113]] = False
    clustered = np.ones(135, dtype=bool)
    clustered[60:65] = False
    a = attainment_interval(block_counts(spread, 9), 0.95)
    b = attainment_interval(block_counts(clustered, 9), 0.95)
    assert a.value == b.value and b.low < a.low


def test_a_pool_is_judged_on_its_blocks_in_the_order_measured() -> None:
    from tuner.measure.verdict import Pool, Sample

    good = Sample(2.0, 0, ((10, 10),) * 60)
    pool = Pool(2.0, 0.975, [good])
    assert pool.verdict() == "met" and pool.requests == 600 and len(pool.blocks()) == 60
    void = Sample(2.0, 1, ((0, 10),) * 60, void="load test failed")
    assert Pool(2.0, 0.975, [good, void]).blocks() == pool.blocks()  # a void sample adds nothing
    assert Pool(2.0, 0.975, [Sample(2.0, 0, ((10, 10),) * 20)]).verdict() == "undecided"  # too few blocks


def test_the_floor_runs_one_request_at_a_time_at_a_rate_it_keeps_up_with(tmp_path: Path) -> None:
    """Requests that hold the engine 4 s each (long outputs on a slow machine) fall ever further behind the floor's
    1 req/s: most of a window's requests would wait, cut off by its end. The first window is a probe: the floor's
    windows run at the rate that keeps one request at a time busy most of the time (KEEP_UP), and says so."""
    from tuner.measure.floor import FLOOR_RATE, KEEP_UP, measure_floor

    spec = MeasurementSpec(min_gaps=30, max_segments=3)
    floor, outcomes = measure_floor(QueueBackend(service_s=4.0, duration=40.0), tmp_path / "slow", spec=spec)
    assert floor.rate == pytest.approx(KEEP_UP / 4.0)
    assert [o.rate for o in outcomes] == [FLOOR_RATE, floor.rate, 2 * floor.rate]  # probe, batch 1, batch 4
    assert f"at {floor.rate:.3g} req/s" in floor.describe()
    assert json.loads((tmp_path / "slow" / "floor.json").read_text())["rate"] == pytest.approx(floor.rate)
    # one request at a time keeps up with 1 req/s: no probe, the rate stays
    quick, outcomes = measure_floor(QueueBackend(service_s=0.25, duration=40.0), tmp_path / "quick", spec=spec)
    assert quick.rate == FLOOR_RATE and [o.rate for o in outcomes] == [FLOOR_RATE, 2 * FLOOR_RATE]
