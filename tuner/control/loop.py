"""The controller's loop: scrape, judge the trigger window and the workload's drift, retune on a trigger (the
simulator within the guardrails), run the candidate as a leased canary, keep or roll it back, log everything.

Nothing is applied that cannot be verified: when the metrics source or the engine does not answer, the controller
says so and waits; a canary it cannot judge is never confirmed, so the engine's lease returns it to the last kept
config by itself.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slotune.slo import SLO
from policies import Policy
from tuner.control.canary import judge
from tuner.control.candidates import Prediction, Search, search
from tuner.control.controller_metrics import ControllerMetrics
from tuner.control.decision_log import DecisionLog, ResumeState, resume
from tuner.control.engine_admin import LeasingEngine, resolved_knobs
from tuner.control.guardrails import changed, cooldown_left
from tuner.control.shape import Shape, shape_of
from tuner.control.sources import MetricsSource, Scrape, SourceUnavailable
from tuner.control.triggers import Trigger, first_trigger
from tuner.control.window import CounterReset, WindowStats, knobs_of, window
from tuner.trials.engine_handle import ConfigRejected, EngineError

WINDOW_COVER = 0.8  # a trigger window must span at least this share of its length within one config generation


def queued(scrape: Scrape) -> int:
    """Requests in the engine (running, waiting or preempted) at a scrape."""
    return round(sum(scrape.get(f"slotune_num_requests_{q}") for q in ("running", "waiting", "preempted")))


@dataclass
class CanaryRun:
    id: int
    generation: int
    kept_knobs: dict[str, Any]  # the changed knobs' values before the canary (what a rollback PATCHes)
    started: float
    start_scrape: Scrape
    before: WindowStats
    trigger: Trigger
    search: Search
    inherited: int  # requests in the engine when the canary started (their latency is partly the old config's)
    fresh_scrape: Scrape | None = None  # the first scrape after those had finished


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

    def __post_init__(self) -> None:
        t, r = self.policy.control.triggers, self.policy.control.retune
        self.keep_s = max(t.window, 2 * t.drift_window, r.step_history) + 4 * self.poll_s
        self.history: deque[Scrape] = deque()
        self.canary: CanaryRun | None = None
        self.state: ResumeState = resume(self.log.records())
        self.reference_since: float | None = None
        # the reference window's shape, kept once measured: its scrapes leave the history after keep_s
        self.reference: Shape | None = None
        self.last_observation = 0.0
        self.source_down = False
        self.slo = SLO(tbt_p99=self.policy.slo.tbt_p99, ttft_p99=self.policy.slo.ttft_p99)
        self.pending_proposal: dict[str, Any] | None = None
        self.engine_dtype: str | None = None  # fixed for an engine's life: asked once, at the first retune

    # ---------------------------------------------------------------------------------------------- running
    def run(self, stop: Callable[[], bool] = lambda: False, proposal: dict[str, Any] | None = None) -> None:
        self.close_open_canary()
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
        if self.reference_since is None:
            self.reference_since = now
        if self.canary is not None:
            self.canary_tick(scrape)
            return
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
        trigger = first_trigger(stats, self.recent_shape(), self.reference_shape(), now,
                                self.state.last_retune_time, self.policy.control.triggers)
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
            if out and (s.get("slotune_config_generation") != out[-1].get("slotune_config_generation")
                        or s.get("slotune_request_itl_p99_seconds_count") >
                        out[-1].get("slotune_request_itl_p99_seconds_count")):
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
        length = self.policy.control.triggers.window
        return self.span(self.history[-1].time - length, length) if self.history else None

    def shape_between(self, start: float, end: float) -> Shape | None:
        scrapes = [s for s in self.since(start) if s.time <= end]
        try:
            intervals = [window(a, b, self.slo) for a, b in itertools.pairwise(scrapes)]
        except CounterReset:
            return None
        return shape_of(intervals) if intervals else None

    def recent_shape(self) -> Shape | None:
        if not self.history:
            return None
        length = self.policy.control.triggers.drift_window
        shape = self.shape_between(self.history[-1].time - length, self.history[-1].time)
        return shape if shape is not None and shape.seconds >= WINDOW_COVER * length else None

    def reference_shape(self) -> Shape | None:
        """The workload's shape after the last decision (or the start), to judge drift against: from then up to
        where the recent window begins, at least a drift window long, and kept once it holds the trigger's minimum
        of requests (the history drops its scrapes after keep_s; at a low rate one drift window may hold too few)."""
        if self.reference is not None:
            return self.reference
        t = self.policy.control.triggers
        if self.reference_since is None or not self.history:
            return None
        start = max(self.reference_since, self.history[0].time)
        end = self.history[-1].time - t.drift_window
        if end - start < t.drift_window:
            return None
        shape = self.shape_between(start, end)
        if shape is None or shape.seconds < WINDOW_COVER * t.drift_window:
            return None
        if shape.requests >= t.min_requests:
            self.reference = shape
        return shape

    def observe(self, scrape: Scrape, stats: WindowStats | None) -> None:
        if scrape.time - self.last_observation < self.observe_every:
            return
        self.last_observation = scrape.time
        recent = self.recent_shape()
        self.log.write("observation", generation=int(scrape.get("slotune_config_generation")),
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
        self.state.last_decision_time = self.state.last_retune_time = record["time"]
        self.state.decisions += 1
        self.reference_since, self.reference = record["time"], None
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
        from tuner.control.warm_start import best_knobs

        knobs, problem = best_knobs(self.storage)
        if problem:
            self.say(f"slotune control: cannot read the study storage {self.storage}: {problem}")
        return knobs

    def act(self, trigger: Trigger, before: WindowStats, proposal: dict[str, Any] | None = None) -> None:
        try:
            payload = self.engine.admin_config()
            if payload.get("lease") is not None:
                self.say("slotune control: the engine holds another lease; not moving")
                return
            steps, _ = self.engine.steps(-1)
        except EngineError as error:
            self.say(f"slotune control: engine unreachable, not acting: {error}")
            self.log.write("event", what="engine_unreachable", detail=str(error))
            return
        current, resolved = dict(payload["config"]), resolved_knobs(payload)
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
                found = search(self.policy, current, resolved, shape, recent_steps, self.study_knobs(),
                               target=self.policy.control.triggers.attainment_target, profile=self.profile,
                               seed=self.state.next_id, backlog=queued(self.history[-1]), admin_config=payload,
                               dtype=self.dtype())
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
        self.start_canary(trigger, before, found, move, current, generation)

    def start_canary(self, trigger: Trigger, before: WindowStats, found: Search, move: dict[str, Any],
                     current: dict[str, Any], generation: int) -> None:
        spec = self.policy.control.canary
        did = self.state.next_id
        try:
            applied = self.engine.apply(move, lease_s=spec.lease_s)
        except ConfigRejected as error:
            self.decide("no_move", trigger, f"the engine rejected the candidate {move}: {error}", candidate=move,
                        before=before.as_dict(), search=found.as_dict())
            return
        except EngineError as error:
            self.say(f"slotune control: engine unreachable, canary not started: {error}")
            return
        self.state.next_id = did + 1
        kept = {k: current.get(k) for k in move}
        self.log.write("canary", id=did, generation=applied["generation"], kept_generation=generation,
                       candidate=move, kept_knobs=kept, lease_s=spec.lease_s, trigger=trigger.as_dict(),
                       before=before.as_dict(), search=found.as_dict())
        self.metrics.canary.set(1)
        self.say(f"slotune control: canary {did}: {move} as generation {applied['generation']} "
                 f"(lease {spec.lease_s:g}s): {found.reason}")
        start = self.scrape()
        first = start or self.history[-1]
        inherited = queued(first)
        self.canary = CanaryRun(did, int(applied["generation"]), kept, time.time(), first, before, trigger, found,
                                inherited)

    def canary_tick(self, scrape: Scrape) -> None:
        run = self.canary
        assert run is not None
        gen = int(scrape.get("slotune_config_generation"))
        fields = {"candidate": changed(run.search.candidate.knobs if run.search.candidate else {}, run.kept_knobs),
                  "before": run.before.as_dict(), "search": run.search.as_dict(), "generation": run.generation}
        if gen != run.generation:
            self.end_canary("abandoned", f"the engine left the canary's generation {run.generation} (now {gen}): "
                                         "its lease expired or someone else changed the config", fields)
            return
        try:
            measured = window(run.start_scrape, scrape, self.slo)
        except CounterReset as error:
            self.end_canary("abandoned", str(error), fields)
            return
        self.observe(scrape, measured)
        if run.fresh_scrape is None and measured.finished >= run.inherited:
            run.fresh_scrape = scrape
        fresh = window(run.fresh_scrape, scrape, self.slo) if run.fresh_scrape is not None else None
        verdict = judge(run.before, measured, scrape.time - run.started, self.policy.control.canary, fresh)
        if verdict.action == "continue":
            return
        fields.update(measured=measured.as_dict(), measured_own=fresh.as_dict() if fresh else None,
                      inherited_requests=run.inherited, verdict=verdict.as_dict())
        try:
            if verdict.action == "keep":
                self.engine.confirm(run.generation)
                self.end_canary("kept", verdict.reason, fields)
            else:
                self.engine.apply(run.kept_knobs)
                self.end_canary("rolled_back", verdict.reason, fields)
        except ConfigRejected as error:
            self.end_canary("abandoned", f"the engine refused to {verdict.action}: {error}", fields)
        except EngineError as error:  # unverifiable: leave it to the lease, try again next tick
            self.say(f"slotune control: engine unreachable during canary {run.id}: {error}")

    def end_canary(self, outcome: str, reason: str, fields: dict[str, Any]) -> None:
        run = self.canary
        assert run is not None
        self.canary = None
        self.metrics.canary.set(0)
        self.decide(outcome, run.trigger, reason, decision_id=run.id, **fields)

    def close_open_canary(self) -> None:
        """A canary the log started but never decided (the controller was killed): roll it back when it is still
        under lease, or record that the engine's lease already did; either way one decision closes it."""
        open_canary = self.state.open_canary
        if open_canary is None:
            return
        trigger = Trigger(**{k: open_canary["trigger"].get(k, "") for k in ("kind", "reason")},
                          evidence=open_canary["trigger"].get("evidence", {}))
        while True:
            try:
                payload = self.engine.admin_config()
                lease = payload.get("lease")
                if lease is not None and int(lease["generation"]) == int(open_canary["generation"]):
                    self.engine.apply(open_canary["kept_knobs"])
                    reason = "the controller restarted mid-canary (its evidence is gone): rolled back to the kept config"
                else:
                    reason = (f"the controller restarted mid-canary; the engine is on generation "
                              f"{payload['generation']}, its lease having returned it to the kept config")
                break
            except EngineError as error:
                self.say(f"slotune control: engine unreachable while closing canary {open_canary['id']}: {error}")
                time.sleep(self.poll_s)
        self.state.open_canary = None
        self.decide("abandoned", trigger, reason, decision_id=int(open_canary["id"]),
                    candidate=open_canary.get("candidate"), generation=open_canary.get("generation"))

