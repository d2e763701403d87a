"""The engine's step records live in a ring buffer (`slotune serve --step-buffer`): GET /debug/steps says how many
records after `since` it dropped, and a trial reads them while its load test runs, so that a fast engine loses
none; a trial that still lost some marks its step statistics (``steps_dropped``) rather than computing them from part
of its window as if it were the whole.

On a real engine with a buffer of 60 records: a trial whose records are read only after its load test reports what
the buffer dropped, and one read every progress tick gets all of them. The trace asks for 17 steps a second at most
(one 16-token request a second, each a prefill and 15 decodes), whatever the engine's speed, so a tick that comes a
few seconds late still finds them in the buffer; on any machine the trial makes more steps than the buffer holds
(each request its 16 steps on a fast one; a slow one is busy throughout)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from engine.step_record import StepRecord, StepRecorder
from slotune.slo import SLO
from policies import WorkloadSpec
from tuner.trials.engine_handle import EngineError, EngineHandle, StepPage
from tuner.trials.step_collector import StepCollector

CAPACITY = 60
TOKEN = "secret"
OUTPUT_TOKENS = 16
# 10 requests in the window: more steps than the buffer holds even where a step takes 0.3 s (a 2-core AVX2 CPU)
WARMUP_S, DURATION_S = 1.0, 10.0


def record(step: int, start_time: float = 0.0) -> StepRecord:
    return StepRecord(step, start_time, *([0.0] * 4), *([0] * 11))


def test_the_recorder_says_how_many_records_after_a_step_it_dropped() -> None:
    recorder = StepRecorder(capacity=4)
    page = recorder.page(-1)
    assert (page.records, page.first_step, page.dropped) == ([], None, 0)
    for i in range(10):
        recorder.append(record(i))
    page = recorder.page(-1)
    assert [r.step for r in page.records] == [6, 7, 8, 9] and page.first_step == 6 and page.dropped == 6
    assert recorder.page(2).dropped == 3  # steps 3, 4, 5
    assert recorder.page(5).dropped == 0 and [r.step for r in recorder.page(5).records] == [6, 7, 8, 9]
    assert recorder.page(7).dropped == 0 and [r.step for r in recorder.page(7).records] == [8, 9]
    assert recorder.page(9).records == [] and recorder.page(9).dropped == 0
    assert recorder.page(-5).dropped == 6  # before the first step: the same as -1
    assert recorder.since(2) == recorder.page(2).records  # the older reading, unchanged
    with pytest.raises(ValueError, match="at least one"):
        StepRecorder(capacity=0)


def test_to_dict_is_asdict() -> None:
    import dataclasses

    r = StepRecord(3, 1.5, 0.1, 0.2, 0.3, 0.6, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)
    assert r.to_dict() == dataclasses.asdict(r) and list(r.to_dict()) == list(dataclasses.asdict(r))


class FakeEngine:
    """/debug/steps of a ring buffer whose steps the test makes."""

    def __init__(self, capacity: int) -> None:
        self.recorder = StepRecorder(capacity)
        self.last = -1
        self.fail = False

    def make(self, n: int) -> None:
        for _ in range(n):
            self.last += 1
            self.recorder.append(record(self.last, start_time=float(self.last)))

    def step_page(self, since: int = -1) -> StepPage:
        if self.fail:
            raise EngineError("gone")
        page = self.recorder.page(since)
        return StepPage([r.to_dict() for r in page.records], self.last, page.dropped)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_collector_reads_in_several_calls_and_counts_the_gaps_that_reach_a_window() -> None:
    engine, clock = FakeEngine(capacity=10), Clock()
    engine.make(3)  # before the trial's cursor
    collector = StepCollector(engine, since=2, interval=2.0, clock=clock)  # type: ignore[arg-type]
    for _ in range(5):  # 8 steps a poll: the buffer of 10 keeps up
        engine.make(8)
        clock.now += 1.0
        collector.poll()  # reads every other call
        clock.now += 1.0
        collector.poll()
    assert [r["step"] for r in collector.records] == list(range(3, 43)) and collector.dropped == 0
    engine.make(25)  # steps 43..67: the buffer keeps 58..67
    assert collector.read()
    assert collector.dropped == 15 and collector.gaps[0].after_s == 42.0 and collector.gaps[0].before_s == 58.0
    assert collector.dropped_in(0.0) == 15 and collector.dropped_in(50.0, 60.0) == 15
    assert collector.dropped_in(0.0, 42.0) == 0 and collector.dropped_in(58.0) == 0  # the gap is outside
    engine.fail = True
    assert not collector.read() and collector.error == "gone" and len(collector.records) == 50


def test_the_handle_counts_the_gap_of_an_engine_that_does_not_say(monkeypatch: pytest.MonkeyPatch) -> None:
    handle = EngineHandle("http://127.0.0.1:1")
    body = {"since": 4, "steps": [record(9).to_dict(), record(10).to_dict()], "last_step": 10}
    monkeypatch.setattr(handle, "_request", lambda *a, **k: httpx.Response(200, json=body))
    page = handle.step_page(4)
    assert page.dropped == 4 and page.last_step == 10 and [r["step"] for r in page.records] == [9, 10]
    assert handle.steps(4) == (page.records, 10)


# ------------------------------------------------------------------------------------------------ a real engine

@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from tests.server_helpers import SubprocessServer

    s = SubprocessServer(args=["--admin-token", TOKEN, "--step-buffer", str(CAPACITY)])
    yield s
    s.stop()


def test_debug_steps_says_which_records_it_no_longer_has(server: Any) -> None:
    before = httpx.get(server.url + "/health").json()["last_step"]
    body = {"prompt": "Count to ten:", "max_tokens": CAPACITY + 20, "temperature": 0, "ignore_eos": True}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=300).status_code == 200
    answer = httpx.get(server.url + "/debug/steps", params={"since": before}).json()
    last = answer["last_step"]
    assert last - before > CAPACITY  # more steps than the buffer holds
    assert answer["capacity"] == CAPACITY and answer["first_step"] == last - CAPACITY + 1
    assert [s["step"] for s in answer["steps"]] == list(range(last - CAPACITY + 1, last + 1))
    assert answer["dropped"] == answer["first_step"] - before - 1 > 0
    held = httpx.get(server.url + "/debug/steps", params={"since": answer["first_step"] - 1}).json()
    assert held["dropped"] == 0 and held["steps"] == answer["steps"]
    limited = httpx.get(server.url + "/debug/steps", params={"since": before, "limit": 5}).json()
    assert limited["dropped"] == answer["dropped"] and limited["steps"] == answer["steps"][:5]
    after = httpx.get(server.url + "/debug/steps", params={"since": last}).json()
    assert (after["steps"], after["dropped"], after["first_step"]) == ([], 0, answer["first_step"])


def trace(folder: Path) -> Path:
    """One 16-token request a second, for the warm-up and the window (the window is [1, 11) s)."""
    path = folder / "trace.jsonl"
    rows = [{"timestamp": 1000 * i, "input_length": 16, "output_length": OUTPUT_TOKENS, "hash_ids": []}
            for i in range(int(WARMUP_S + DURATION_S))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trial(server: Any, folder: Path, step_poll_s: float | None) -> tuple[Any, list[dict[str, Any]], int]:
    """A trial's outcome, its steps.jsonl and how many steps the engine made in it."""
    from tuner.trials.trial_runner import TrialRunner

    handle = EngineHandle(server.url, TOKEN)
    runner = TrialRunner(handle, workload=WorkloadSpec(str(trace(folder))), rate=1.0, duration=DURATION_S,
                         warmup=WARMUP_S, slo=SLO(tbt_p99=5.0), step_poll_s=step_poll_s)
    before = handle.health()["last_step"]
    outcome = runner.run({}, folder / "trial")
    made = handle.health()["last_step"] - before
    assert outcome.summary["requests"] == DURATION_S and outcome.summary["completed"] == DURATION_S, outcome.summary
    steps = [json.loads(line) for line in (folder / "trial" / "steps.jsonl").read_text().splitlines()]
    assert json.loads((folder / "trial" / "trial.json").read_text())["step_stats"] == outcome.step_stats
    return outcome, steps, made


def test_a_trial_read_after_its_load_test_reports_the_records_the_engine_dropped(server: Any,
                                                                                  tmp_path: Path) -> None:
    outcome, steps, made = trial(server, tmp_path, step_poll_s=None)
    assert made > CAPACITY, f"{made} steps: the trial must make more than the buffer holds"
    # the one read got the buffer's last records; all those before were dropped (the warm-up's and the window's
    # first: the gap reaches into the window, so it counts whole)
    assert outcome.step_stats["steps_dropped"] == made - CAPACITY
    assert len(steps) <= CAPACITY and outcome.step_stats["steps"] == len(steps)


def test_a_trial_read_during_its_load_test_keeps_every_record(server: Any, tmp_path: Path) -> None:
    outcome, steps, made = trial(server, tmp_path, step_poll_s=0.5)  # at every progress tick
    assert outcome.step_stats["steps_dropped"] == 0
    assert len(steps) > CAPACITY, f"{len(steps)} steps in the window of {made}: more than the buffer holds"
    assert [s["step"] for s in steps] == list(range(steps[0]["step"], steps[0]["step"] + len(steps)))
    assert outcome.step_stats["steps"] == len(steps)
