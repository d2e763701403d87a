"""The controller's log: one JSONL line per record, appended and flushed at once so a killed controller loses
nothing it wrote. Kinds: ``observation`` (attainment, shape and knobs at a time), ``canary`` (a canary started:
its candidate, plan, trigger and lease), ``canary_block`` (a block of its switchback began: which config, its
generation and lease), ``decision`` (one per trigger acted on: kept, rolled_back, advised, no_move,
abandoned; with trigger, evidence, candidate, predicted and measured effect, and why), ``event`` (an outage).

A restarted controller reads the log back (:func:`resume`): decision ids continue, the cool-down runs from the last
decision, a canary without its decision is closed (never decided twice), and the moves rolled back since the
workload last drifted are not tried again."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ResumeState:
    next_id: int = 1
    last_decision_time: float | None = None
    last_retune_time: float | None = None
    open_canary: dict[str, Any] | None = None  # a canary record whose decision was never written
    decisions: int = 0
    # moves canaried and rolled back since the workload last drifted ({"from": kept values, "to": the move}): not
    # screened again, so the same move is not tried over and over
    rolled_back: list[dict[str, Any]] = field(default_factory=list)

    def note_decision(self, record: dict[str, Any]) -> None:
        """What a decision record changes: ids, the cool-down's start, the memory of rolled-back moves."""
        self.decisions += 1
        self.last_decision_time = self.last_retune_time = float(record["time"])
        self.next_id = max(self.next_id, int(record["id"]) + 1)
        if (record.get("trigger") or {}).get("kind") == "drift":
            self.rolled_back = []  # the workload changed: what failed before may not fail now
        if record.get("outcome") == "rolled_back" and record.get("candidate") and record.get("kept_knobs"):
            self.rolled_back.append({"from": record["kept_knobs"], "to": record["candidate"],
                                     "time": record["time"]})


class DecisionLog:
    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"kind": kind, "time": time.time(), **fields}
        if self.path is not None:
            with open(self.path, "ab+") as f:
                end = f.seek(0, 2)
                if end > 0:  # a line cut short by a kill: end it, so this record stays a line of its own
                    f.seek(end - 1)
                    if f.read(1) != b"\n":
                        f.write(b"\n")
                f.write((json.dumps(record, default=str) + "\n").encode("utf-8"))
                f.flush()
        return record

    def records(self) -> list[dict[str, Any]]:
        return read_log(self.path) if self.path is not None else []


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """Every complete line of the log (a line cut short by a kill is left out)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def resume(records: list[dict[str, Any]]) -> ResumeState:
    state = ResumeState()
    decided: set[int] = set()
    canaries: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("kind") == "decision":
            decided.add(int(r["id"]))
            state.note_decision(r)
        elif r.get("kind") == "canary":
            canaries[int(r["id"])] = r
            state.next_id = max(state.next_id, int(r["id"]) + 1)
        elif r.get("kind") == "canary_block" and int(r["id"]) in canaries:  # the block in force when it died
            held = canaries[int(r["id"])]
            canaries[int(r["id"])] = {**held, "replicas": r.get("replicas", held.get("replicas")),
                                      "lease_until": r.get("lease_until") or held.get("lease_until")}
    open_ids = sorted(set(canaries) - decided)
    state.open_canary = canaries[open_ids[-1]] if open_ids else None
    return state
