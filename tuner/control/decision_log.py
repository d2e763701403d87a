"""The controller's log: one JSONL line per record, appended and flushed at once so a killed controller loses
nothing it wrote. Kinds: ``observation`` (attainment, shape and knobs at a time), ``canary`` (a canary started:
its candidate, trigger and lease), ``decision`` (one per trigger acted on: kept, rolled_back, advised, no_move,
abandoned; with trigger, evidence, candidate, predicted and measured effect, and why), ``event`` (an outage).

A restarted controller reads the log back (:func:`resume`): decision ids continue, the cool-down runs from the last
decision, and a canary without its decision is closed (never decided twice)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class ResumeState:
    next_id: int = 1
    last_decision_time: float | None = None
    last_retune_time: float | None = None
    open_canary: dict[str, Any] | None = None  # a canary record whose decision was never written
    decisions: int = 0


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
            state.decisions += 1
            state.last_decision_time = float(r["time"])
            state.last_retune_time = float(r["time"])
            state.next_id = max(state.next_id, int(r["id"]) + 1)
        elif r.get("kind") == "canary":
            canaries[int(r["id"])] = r
            state.next_id = max(state.next_id, int(r["id"]) + 1)
    open_ids = sorted(set(canaries) - decided)
    state.open_canary = canaries[open_ids[-1]] if open_ids else None
    return state
