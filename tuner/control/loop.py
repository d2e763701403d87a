"""The controller's loop: scrape, judge the trigger window and the workload's drift, retune on a trigger (the
simulator within the guardrails), run the candidate as a leased canary, keep or roll it back, log everything.

Nothing is applied that cannot be verified: when the metrics source or the engine does not answer, the controller
says so and waits; a canary it cannot judge is never confirmed, so the engine's lease returns it to the last kept
config by itself.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine import metric_names as names
from policies import Policy
from slotune.slo import SLO
from tuner.control.canary import plan_switchback
from tuner.control.canary_run import CanaryRun, Ending, roll_back_open
from tuner.control.candidates import Prediction, Search, search
from tuner.control.controller_metrics import ControllerMetrics
from tuner.control.decision_log import DecisionLog, ResumeState, resume
from tuner.control.engine_admin import LeasingEngine, resolved_knobs
from tuner.control.guardrails import changed, cooldown_left
from tuner.control.low_priority import at_low_priority
from tuner.control.attainment import AttainmentMonitor, Counts
from tuner.control.drift import DriftMonitor
from tuner.control.shape import Shape, shape_of
from tuner.control.sources import MetricsSource, Scrape, SourceUnavailable
from tuner.control.triggers import Trigger, first_trigger
from tuner.control.window import CounterReset, LookClock, WindowStats, knobs_of, queued, window
from tuner.trials.engine_handle import ConfigRejected, EngineError

WINDOW_COVER = 0.8  # a trigger window must span at least this share of its length within one config generation


def service_time(before: WindowStats, found: Search) -> float:
    """How long a request runs from its first token to its last, under the applied config (measured in the window
    before) or the candidate (its predicted mean gap times the same outputs), the longer: a switchback block settles
    for that long."""
    predicted = found.candidate.figure("tbt_mean", math.nan) * before.mean_output if found.candidate else math.nan
    return max((t for t in (before.service_s, predicted) if math.isfinite(t)), default=math.nan)


@dataclass
class Controller:
    policy: Policy
    source: MetricsSource
    engine: LeasingEngine
    log: DecisionLog
    metrics: ControllerMetrics = field(default_factory=ControllerMetrics)
    mode: str = "act"  # "act" | "advisory"
    poll_s: float = 2.0
    observe_every: float = 10.0
    profile: str | None = None
    storage: str | None = None
    say: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)
    # every replica of a fleet behind the source (its replicas' scrapes in that order); None: the one engine
    fleet: list[LeasingEngine] | None = None

    def __post_init__(self) -> None:
        self.replicas: list[LeasingEngine] = list(self.fleet or [self.engine])
        t, r = self.policy.control.triggers, self.policy.control.retune
        self.keep_s = max(t.window, 2 * t.drift_window, r.step_history) + 4 * self.poll_s
        self.history: deque[Scrape] = deque()
        self.canary: CanaryRun | None = None
        self.state: ResumeState = resume(self.log.records())
        self.drift = DriftMonitor(t)
        self.attainment = AttainmentMonitor(t, self.policy.control.canary.min_effect)
        self.drift_clock = LookClock(t.drift_window)
        self.attainment_clock = LookClock(t.window)
        self.last_observation = 0.0
        self.source_down = False
        self.pending_proposal: dict[str, Any] | None = None
        self.engine_dtype: str | None = None  # fixed for an engine's life: asked once, at the first retune

    @property
    def slo(self) -> SLO:
        """The policy's whole SLO: what every window and canary is judged against."""
        return self.policy.slo

    # ---------------------------------------------------------------------------------------------- running
    def run(self, stop: Callable[[], bool] = lambda: False, proposal: dict[str, Any] | None = None) -> None:
        self.close_open_canary(stop)
        self.pending_proposal = dict(proposal) if proposal else None
        while not stop():
            started = time.monotonic()
            self.tick()
            time.sleep(max(0.0, self.poll_s - (time.monotonic() - started)))

    def tick(self) -> None:
        scrape = self.scrape()
        if scrape is None:
            return
        now = scrape.time
        if self.canary is not None:
            self.canary_tick(scrape)
            return
        alarm = self.drift_look(now)
        shortfall = self.attainment_look(now)
        stats = self.trigger_window()
        if stats is not None:
            self.metrics.attainment.set(stats.attainment.value)
        self.observe(scrape, stats)
        if cooldown_left(now, self.state.last_decision_time, self.policy.control.guardrails) > 0:
            return
        if self.pending_proposal is not None and stats is not None:
            knobs, self.pending_proposal = self.pending_proposal, None
            self.act(Trigger("proposal", "an operator's proposed config (--propose)", {"knobs": knobs}), stats,
                     proposal=knobs)
            return
        trigger = first_trigger(stats, shortfall, alarm, now, self.state.last_retune_time,
                                self.policy.control.triggers)
        if trigger is not None and stats is not None:
            self.metrics.triggers.labels(kind=trigger.kind).inc()
            self.act(trigger, stats)

    def scrape(self) -> Scrape | None:
        try:
            scrape = self.source.scrape()
        except SourceUnavailable as error:
            self.metrics.source_up.set(0)
            if not self.source_down:
                self.say(f"slotune control: metrics source unreachable, waiting and retrying: {error}")
                self.log.write("event", what="source_unreachable", detail=str(error))
            self.source_down = True
            return None
        if self.source_down:
            self.say("slotune control: metrics source answers again")
            self.log.write("event", what="source_back")
        self.source_down = False
        self.metrics.source_up.set(1)
        self.remember(scrape)
        return scrape

    def remember(self, scrape: Scrape) -> None:
        """Keep the scrape, and those of the last keep_s seconds before it."""
        self.history.append(scrape)
        while self.history and self.history[0].time < scrape.time - self.keep_s:
            self.history.popleft()

    # ---------------------------------------------------------------------------------------------- windows
    def since(self, start: float) -> list[Scrape]:
        """Scrapes from ``start`` on, cut at the latest config change or counter reset (one generation)."""
        out: list[Scrape] = []
        for s in reversed(self.history):
            if s.time < start:
                break
            if out and (s.get(names.CONFIG_GENERATION) != out[-1].get(names.CONFIG_GENERATION)
                        or s.get(names.hist_count(names.REQUEST_ITL_P99)) >
                        out[-1].get(names.hist_count(names.REQUEST_ITL_P99))):
                break
            out.append(s)
        return out[::-1]

    def span(self, start: float, length: float) -> WindowStats | None:
        scrapes = self.since(start)
        if len(scrapes) < 2 or scrapes[-1].time - scrapes[0].time < WINDOW_COVER * length:
            return None
        try:
            return window(scrapes[0], scrapes[-1], self.slo)
        except CounterReset:
            return None

    def trigger_window(self) -> WindowStats | None:
        """The last ``triggers.window`` seconds, or, where they hold fewer than ``min_requests`` finished requests
        (a low rate), as many whole windows back as it takes, within the history and the config generation: one
        window of a low rate would never be judged, and a config that misses its SLO would never be noticed."""
        if not self.history:
            return None
        t = self.policy.control.triggers
        stats = None
        for windows in range(1, int(self.keep_s // t.window) + 1):
            longer = self.span(self.history[-1].time - windows * t.window, windows * t.window)
            if longer is None:
                break
            stats = longer
            if stats.finished >= t.min_requests:
                break
        return stats

    def intervals_between(self, start: float, end: float) -> list[WindowStats] | None:
        """Each scrape interval from ``start`` to ``end`` within one generation; None across a counter reset."""
        scrapes = [s for s in self.since(start) if s.time <= end]
        try:
            return [window(a, b, self.slo) for a, b in itertools.pairwise(scrapes)]
        except CounterReset:
            return None

    def shape_between(self, start: float, end: float) -> Shape | None:
        intervals = self.intervals_between(start, end)
        return shape_of(intervals) if intervals else None

    def recent_shape(self) -> Shape | None:
        if not self.history:
            return None
        length = self.policy.control.triggers.drift_window
        shape = self.shape_between(self.history[-1].time - length, self.history[-1].time)
        return shape if shape is not None and shape.seconds >= WINDOW_COVER * length else None

    def drift_look(self, now: float) -> dict[str, Any] | None:
        """Every drift window (consecutive, within one config generation), its shape to the drift monitor; the
        monitor's alarm, if it raised one."""
        if (start := self.drift_clock.due(now)) is None:
            return None
        shape = self.shape_between(start, now)
        if shape is None or shape.seconds < WINDOW_COVER * self.drift_clock.length:
            return None  # the window spans an engine restart or a config change: not a look at one traffic
        return self.drift.add(shape)

    def attainment_look(self, now: float) -> dict[str, Any] | None:
        """Every trigger window (consecutive, within one config generation), its requests to the attainment
        monitor; the monitor's alarm, if it raised one."""
        if (start := self.attainment_clock.due(now)) is None:
            return None
        stats = self.intervals_between(start, now)
        if stats is None:
            return None
        intervals = [Counts(w.seconds, w.finished, w.missed_tbt, w.missed_ttft, w.missed_e2e) for w in stats]
        if sum(c.seconds for c in intervals) < WINDOW_COVER * self.attainment_clock.length:
            return None  # the window spans an engine restart or a config change
        return self.attainment.add(intervals)

    def observe(self, scrape: Scrape, stats: WindowStats | None) -> None:
        if scrape.time - self.last_observation < self.observe_every:
            return
        self.last_observation = scrape.time
        recent = self.recent_shape()
        self.log.write("observation", generation=int(scrape.get(names.CONFIG_GENERATION)),
                       knobs=knobs_of(scrape), attainment=stats.attainment.as_dict() if stats else None,
                       window=stats.as_dict() if stats else None, shape=recent.as_dict() if recent else None,
                       canary=self.canary.id if self.canary else None, mode=self.mode)

    # ---------------------------------------------------------------------------------------------- acting
    def decide(self, outcome: str, trigger: Trigger, reason: str, decision_id: int | None = None,
               **fields: Any) -> None:
        did = decision_id if decision_id is not None else self.state.next_id
        self.state.next_id = max(self.state.next_id, did + 1)
        record = self.log.write("decision", id=did, outcome=outcome, trigger=trigger.as_dict(), reason=reason,
                                mode=self.mode, **fields)
        self.state.note_decision(record)
        self.drift.reset()  # the traffic after a decision is the next reference
        self.attainment.reset()
        self.drift_clock.restart()
        self.attainment_clock.restart()
        self.metrics.decided(outcome)
        self.say(f"slotune control: decision {did}: {outcome} ({trigger.kind}): {reason}")

    def dtype(self) -> str | None:
        """The engine's dtype (its step-time profile's), from /health the first time it answers."""
        if self.engine_dtype is None:
            self.engine_dtype = (self.engine.health() or {}).get("dtype")
        return self.engine_dtype

    def study_knobs(self) -> list[dict[str, Any]]:
        """The best feasible configs of every study in the shared storage (a warm start for the screen)."""
        if not self.storage:
            return []
        from tuner.control.warm_start import best_knobs  # sqlalchemy: heavy, only with a study storage

        knobs, problem = best_knobs(self.storage)
        if problem:
            self.say(f"slotune control: cannot read the study storage {self.storage}: {problem}")
        return knobs

    def act(self, trigger: Trigger, before: WindowStats, proposal: dict[str, Any] | None = None) -> None:
        try:
            payloads = [engine.admin_config() for engine in self.replicas]
            payload = payloads[0]
            held = [(r, p["lease"]) for r, p in enumerate(payloads) if p.get("lease") is not None]
            if held:  # a decision all the same: the cool-down, not a re-fire every poll
                self.decide("no_move", trigger, f"the engine holds another lease (replica {held[0][0]}, generation "
                                                f"{held[0][1].get('generation')}): not moving",
                            before=before.as_dict())
                return
            differ = [r for r, p in enumerate(payloads) if p["config"] != payload["config"]]
            if differ:
                self.decide("no_move", trigger, f"the replicas run different configs (replica {differ[0]}: "
                                                f"{changed(payloads[differ[0]]['config'], payload['config'])}): a "
                                                "canary needs them alike", before=before.as_dict())
                return
            steps, _ = self.engine.steps(-1)
        except EngineError as error:
            self.say(f"slotune control: engine unreachable, not acting: {error}")
            self.log.write("event", what="engine_unreachable", detail=str(error))
            return
        current, resolved = dict(payload["config"]), resolved_knobs(payload)
        if trigger.kind == "drift":  # the workload changed: the moves rolled back before may serve it now
            self.state.rolled_back = []
        generation = int(payload["generation"])
        if proposal is not None:
            found = Search(Prediction({**current, **proposal}, {}), Prediction(current, {}),
                           "proposed by the operator (not screened)", 0)
        else:
            horizon = before.end - self.policy.control.retune.step_history
            recent_steps = [s for s in steps if s["config_generation"] == generation and s["start_time"] >= horizon]
            shape = self.recent_shape() or self.shape_between(before.start, before.end)
            if shape is None:  # the counters reset under us (an engine restart): judge again on fresh windows
                self.engine_dtype = None  # and ask the restarted engine its dtype
                return
            try:
                found = at_low_priority(lambda: search(
                    self.policy, current, resolved, shape, recent_steps, self.study_knobs(),
                    target=self.policy.control.triggers.attainment_target, profile=self.profile,
                    seed=self.state.next_id, backlog=queued(self.history[-1]), admin_config=payload,
                    dtype=self.dtype(), rolled_back=self.state.rolled_back))
            except Exception as error:  # a retune that fails is a decision not to move; the controller keeps watching
                self.decide("no_move", trigger, f"the retune failed: {type(error).__name__}: {error}",
                            before=before.as_dict(), shape=shape.as_dict())
                return
        evidence: dict[str, Any] = {"before": before.as_dict(), "search": found.as_dict()}
        if found.candidate is None:
            self.decide("no_move", trigger, found.reason, **evidence)
            return
        move = changed(found.candidate.knobs, current)
        if self.mode == "advisory":
            self.decide("advised", trigger, f"would canary {move}: {found.reason}", candidate=move, **evidence)
            return
        self.start_canary(trigger, before, found, move, current, [int(p["generation"]) for p in payloads])

    def start_canary(self, trigger: Trigger, before: WindowStats, found: Search, move: dict[str, Any],
                     current: dict[str, Any], generations: list[int]) -> None:
        spec = self.policy.control.canary
        did = self.state.next_id
        gain = found.candidate.attainment - found.current.attainment if found.candidate and found.current.summary \
            else 0.0
        plan = plan_switchback(spec, before.arrival_rate, before.attainment.value, gain, seed=did,
                               fleet=len(self.replicas), service_s=service_time(before, found),
                               service_gain=math.nan if before.kept_up or not found.candidate else
                               found.candidate.throughput - found.current.throughput)
        evidence: dict[str, Any] = {"before": before.as_dict(), "search": found.as_dict()}
        # the window before stands in for the applied config in the rollback rule only where it kept up: one whose
        # queue grew was better than what follows it for the shorter queue, not for its config
        reference = (before.attaining, before.finished) if before.kept_up else None
        run = CanaryRun(did, plan, spec, {k: current.get(k) for k in move}, move, trigger, evidence, reference,
                        self.replicas, dict(enumerate(generations)))
        try:
            run.switch(0, self.log, time.time())
        except ConfigRejected as error:
            self.decide("no_move", trigger, f"the engine rejected the candidate {move}: {error}", candidate=move,
                        **evidence)
            return
        except EngineError as error:
            self.say(f"slotune control: engine unreachable, canary not started: {error}")
            return
        self.state.next_id = did + 1
        self.log.write("canary", id=did, kept_generations=generations, candidate=move, kept_knobs=run.kept_knobs,
                       lease_s=plan.lease_s, lease_until=run.lease_until, plan=plan.as_dict(),
                       replicas={r: {"url": s.engine.url, "arm": s.arm, "generation": s.generation}
                                 for r, s in run.replicas.items()}, trigger=trigger.as_dict(), **evidence)
        self.metrics.canary.set(1)
        where = f"on replicas {plan.replicas[0]} and {plan.replicas[1]} in turn, the other as control" \
            if len(plan.replicas) > 1 else "taking turns with the applied config"
        self.say(f"slotune control: canary {did}: {move} {where}, {plan.pairs} pairs of {plan.block_s:g}s blocks "
                 f"(power {plan.power:.0%} for +{plan.effect:.0%}): {found.reason}")
        self.canary = run

    def canary_tick(self, scrape: Scrape) -> None:
        run = self.canary
        assert run is not None  # called only while a canary runs
        self.observe(scrape, None)
        ending = run.tick(scrape, self.log, self.slo)
        if ending is not None:
            self.end_canary(ending)

    def end_canary(self, ending: Ending) -> None:
        run = self.canary
        assert run is not None  # called only while a canary runs
        self.canary = None
        self.metrics.canary.set(0)
        self.decide(ending.outcome, run.trigger, ending.reason, decision_id=run.id, **ending.fields)

    def close_open_canary(self, stop: Callable[[], bool] = lambda: False) -> None:
        """A canary the log started but never decided (the controller was killed): rolled back where it still runs
        (canary_run.roll_back_open); one decision closes it."""
        open_canary = self.state.open_canary
        if open_canary is None:
            return
        trigger = Trigger(**{k: open_canary["trigger"].get(k, "") for k in ("kind", "reason")},
                          evidence=open_canary["trigger"].get("evidence", {}))
        what = roll_back_open(open_canary, self.replicas, self.poll_s, self.say, stop)
        self.state.open_canary = None
        self.decide("abandoned", trigger, f"the controller restarted mid-canary (its evidence is gone): {what}",
                    decision_id=int(open_canary["id"]), candidate=open_canary.get("candidate"),
                    kept_knobs=open_canary.get("kept_knobs"))
