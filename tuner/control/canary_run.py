"""A running canary: the plan's blocks driven on the engine or on two replicas of a fleet (the candidate under a
lease, the applied config kept), each block's measured part read from the replicas' scrapes, and the verdict
enacted once: a kept candidate goes to every replica of the fleet, a rollback returns the replica that ran it.

A verdict is final: once reached, later ticks only retry the PATCH that enacts it (a failed rollback is never
judged again and kept). When an engine does not answer, the retries end where the lease of the candidate's last
block ran out: an engine that is up has returned to the kept config by itself by then."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine import metric_names as names
from policies.control import Canary
from slotune.slo import SLO
from tuner.control.canary import Block, CanaryVerdict, SwitchbackPlan, judge_switchback
from tuner.control.decision_log import DecisionLog
from tuner.control.engine_admin import LeasingEngine
from tuner.control.sources import Scrape
from tuner.control.window import CounterReset, WindowStats, window
from tuner.trials.engine_handle import ConfigRejected, EngineError

OUTCOMES = {"keep": "kept", "rollback": "rolled_back", "abandon": "abandoned"}


@dataclass(frozen=True)
class Ending:
    """How a canary ended: the decision's outcome, why, and its evidence."""

    outcome: str  # "kept" | "rolled_back" | "abandoned"
    reason: str
    fields: dict[str, Any]


def judged_block(index: int, arm: str, stats: WindowStats | None, generation: int, replica: int = 0,
                 backlogged: bool = False) -> Block:
    """A block's measured part as the verdict counts it: over the requests that finished, or over those that
    arrived when its queue grew (those it left waiting had not attained)."""
    if stats is None:
        return Block(index, arm, 0, 0, 0, 0, generation, replica)
    return Block(index, arm, stats.attaining, max(stats.finished, stats.arrived), stats.finished, stats.arrived,
                 generation, replica, stats.seconds, backlogged)


def waiting(scrape: Scrape | None) -> bool:
    return scrape is not None and scrape.get(names.WAITING) > 0


@dataclass
class Replica:
    """One replica the canary drives: the config it runs and the scrapes of its block's measured part."""

    engine: LeasingEngine
    generation: int
    arm: str = "applied"
    measure_from: Scrape | None = None
    last: Scrape | None = None


@dataclass
class CanaryRun:
    id: int
    plan: SwitchbackPlan
    spec: Canary
    kept_knobs: dict[str, Any]  # the changed knobs' values in the applied config (an applied block PATCHes them)
    move: dict[str, Any]  # the candidate's changed knobs
    trigger: Any
    evidence: dict[str, Any]  # the trigger window and the search, for the decision record
    before: tuple[int, int] | None  # (attaining, judged) of the window before: a rollback's stand-in for the applied
    fleet: list[LeasingEngine]  # every replica (one engine: itself); a kept candidate goes to all of them
    generations: dict[int, int]  # the generation in force on each replica the plan drives, at the start
    block_started: float = 0.0
    lease_until: float | None = None  # wall clock: when the lease of the candidate's last block runs out
    block: int = -1
    replicas: dict[int, Replica] = field(default_factory=dict)
    blocks: list[Block] = field(default_factory=list)
    final: CanaryVerdict | None = None
    final_since: float | None = None
    enacted: set[int] = field(default_factory=set)  # replicas the final verdict has reached (retries skip them)

    def __post_init__(self) -> None:
        self.replicas = {r: Replica(self.fleet[r], self.generations[r]) for r in self.plan.replicas}

    def fields(self) -> dict[str, Any]:
        return {"candidate": self.move, "kept_knobs": self.kept_knobs, "plan": self.plan.as_dict(),
                "blocks": [b.as_dict() for b in self.blocks],
                "generations": {r: s.generation for r, s in self.replicas.items()}, **self.evidence}

    # ---------------------------------------------------------------------------------------------- blocks
    def switch(self, block: int, log: DecisionLog, now: float) -> None:
        """Start block ``block``: PATCH each driven replica whose config changes (the candidate under a lease)."""
        for r, arm in self.plan.assignment(block).items():
            replica = self.replicas[r]
            if arm != replica.arm:
                lease = self.plan.lease_s if arm == "candidate" else None
                applied = replica.engine.apply(self.move if arm == "candidate" else self.kept_knobs, lease_s=lease)
                replica.generation, replica.arm = int(applied["generation"]), arm
                if lease is not None:
                    self.lease_until = now + lease
        for replica in self.replicas.values():
            replica.measure_from = replica.last = None
        self.block, self.block_started = block, now
        log.write("canary_block", id=self.id, block=block, lease_until=self.lease_until,
                  replicas={r: {"url": s.engine.url, "arm": s.arm, "generation": s.generation}
                            for r, s in self.replicas.items()})

    def tick(self, scrape: Scrape, log: DecisionLog, slo: SLO) -> Ending | None:
        if self.final is not None:
            return self.enact(scrape.time)
        views = scrape.replicas or (scrape,)
        into = scrape.time - self.block_started
        for r, replica in self.replicas.items():
            generation = int(views[r].get(names.CONFIG_GENERATION))
            if generation != replica.generation:
                return Ending("abandoned", f"replica {r} left the canary's generation {replica.generation} (now "
                                           f"{generation}): a lease expired or someone else changed the config",
                              self.fields())
            if into >= self.plan.settle_s:
                if replica.measure_from is None:
                    replica.measure_from = views[r]
                else:
                    replica.last = views[r]
        if into < self.plan.block_s:
            return None
        try:
            for r, replica in self.replicas.items():
                stats = window(replica.measure_from, replica.last, slo) if replica.measure_from and replica.last \
                    else None
                backlogged = waiting(replica.measure_from) and waiting(replica.last)
                self.blocks.append(judged_block(self.block, replica.arm, stats, replica.generation, r, backlogged))
        except CounterReset as error:
            return Ending("abandoned", str(error), self.fields())
        verdict = judge_switchback(self.blocks, self.plan, self.spec, self.before)
        if verdict.action != "continue":
            self.final, self.final_since = verdict, scrape.time
            return self.enact(scrape.time)
        try:
            self.switch(self.block + 1, log, scrape.time)
        except ConfigRejected as error:
            return Ending("abandoned", f"the engine refused block {self.block + 1}'s config: {error}", self.fields())
        except EngineError as error:  # no evidence about the config: back to the kept one, as a rollback does
            self.final = CanaryVerdict("abandon", f"the engine did not answer the switch to block {self.block + 1} "
                                                  f"({error})", verdict.difference)
            self.final_since = scrape.time
            return self.enact(scrape.time)
        return None

    # ---------------------------------------------------------------------------------------------- the end
    def enact(self, now: float) -> Ending | None:
        """PATCH what the verdict says (nothing where the config in force already is it); None while an engine
        does not answer and the lease may still hold."""
        verdict = self.final
        assert verdict is not None  # only called once a verdict is final
        fields = {**self.fields(), "verdict": verdict.as_dict()}
        keep = verdict.action == "keep"
        try:
            for r, engine in enumerate(self.fleet):
                replica = self.replicas.get(r)
                if r in self.enacted:
                    continue
                if keep and replica is not None and replica.arm == "candidate":
                    engine.confirm(replica.generation)
                elif keep:
                    generation = int(engine.apply(self.move)["generation"])
                    if replica is not None:
                        replica.generation, replica.arm = generation, "candidate"
                elif replica is not None and replica.arm == "candidate":
                    replica.generation = int(engine.apply(self.kept_knobs)["generation"])
                    replica.arm = "applied"
                self.enacted.add(r)
        except ConfigRejected as error:
            return Ending("abandoned", f"the engine refused to {verdict.action}: {error}", fields)
        except EngineError as error:
            leased = any(s.arm == "candidate" for s in self.replicas.values())
            deadline = self.lease_until if leased and self.lease_until else (self.final_since or now) + \
                self.plan.lease_s
            if now < deadline:
                return None
            if keep:
                return Ending("abandoned", f"{verdict.reason}; but the engine did not answer until the candidate's "
                                           f"lease ran out ({error})", fields)
            return Ending(OUTCOMES[verdict.action], f"{verdict.reason}; the engine did not answer the rollback, and "
                                                    f"the candidate's lease ran out ({error})", fields)
        return Ending(OUTCOMES[verdict.action], verdict.reason, {**self.fields(), "verdict": verdict.as_dict()})


def roll_back_open(open_canary: dict[str, Any], replicas: list[LeasingEngine], poll_s: float,
                   say: Callable[[str], None], stop: Callable[[], bool]) -> str:
    """Roll back a canary the log started but never decided (the controller was killed): each replica that still
    runs its candidate under lease goes back to the kept config, the others are on it already. An engine that does
    not answer is asked until the candidate's lease has run out: by then the engine, if it is up, has returned to
    the kept config by itself. What was done, in words."""
    lease_until = float(open_canary.get("lease_until") or open_canary["time"] + float(open_canary["lease_s"]))
    by_url = {engine.url: engine for engine in replicas}
    driven = [(by_url.get(str(v["url"]).rstrip("/")), int(v["generation"]))
              for v in (open_canary.get("replicas") or {}).values()]
    rolled, left = [], [(e, g) for e, g in driven if e is not None]
    reason = ""
    while left:
        engine, generation = left[0]
        try:
            lease = engine.admin_config().get("lease")
            if lease is not None and int(lease["generation"]) == generation:
                engine.apply(open_canary["kept_knobs"])
                rolled.append(engine.url)
            left.pop(0)
        except EngineError as error:
            if time.time() >= lease_until or stop():
                reason = (f"; {engine.url} did not answer ({error}) until the candidate's lease had run out: an "
                          "engine that is up is back on the kept config")
                break
            say(f"slotune control: engine unreachable while closing canary {open_canary['id']}: {error}")
            time.sleep(min(poll_s, max(0.0, lease_until - time.time())))
    what = f"rolled back {', '.join(rolled)} to the kept config" if rolled else \
        "the engine is on the kept config (its lease returned it, or the canary's applied block was in force)"
    return what + reason
