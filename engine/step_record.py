"""What every engine step did: one record per step, kept in a ring buffer and optionally appended to JSONL.
The simulator is calibrated from these records and the dashboard draws them."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


@dataclass(frozen=True)
class StepRecord:
    step: int
    start_time: float  # wall clock (time.time()) at the start of the step
    schedule_s: float
    forward_s: float
    sample_s: float
    total_s: float
    num_prefill_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_preempted: int  # sequences in the preempted queue after scheduling
    kv_blocks_used: int
    kv_blocks_free: int
    num_preemptions: int  # preemptions made in this step
    prefix_cache_hit_tokens: int
    config_generation: int
    context_tokens: int = 0  # tokens attended over, summed over the batch (for the step-time model)
    num_swapped_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def to_dict(self) -> dict[str, Any]:
        # the fields are scalars: no deep copy (dataclasses.asdict takes ~15x longer, and /debug/steps turns
        # thousands of records into dicts on the server's event loop)
        return {name: getattr(self, name) for name in _FIELDS}


_FIELDS = tuple(f.name for f in dataclasses.fields(StepRecord))


@dataclass(frozen=True)
class StepPage:
    """What the buffer holds after a step: its records, the oldest step it still holds and how many steps after the
    one asked for it no longer has (the ring buffer dropped them before anyone read them)."""

    records: list[StepRecord]
    first_step: int | None  # the oldest step held (None: none yet)
    dropped: int


class StepRecorder:
    """A thread-safe ring buffer of the last ``capacity`` step records, indexed by step number (the engine numbers
    its steps 0, 1, 2, ... without a gap)."""

    def __init__(self, capacity: int = 10_000, jsonl_path: str | Path | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"the step-record buffer must hold at least one record, got {capacity}")
        self.capacity = capacity
        self._records: deque[StepRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._file: IO[str] | None = open(jsonl_path, "a", encoding="utf-8") if jsonl_path else None

    def append(self, record: StepRecord) -> None:
        with self._lock:
            self._records.append(record)
            if self._file is not None:
                self._file.write(json.dumps(record.to_dict()) + "\n")
                self._file.flush()

    def since(self, step: int = -1) -> list[StepRecord]:
        """Records of the steps after `step` that are still in the buffer, oldest first."""
        return self.page(step).records

    def page(self, step: int = -1) -> StepPage:
        """The records after `step` still in the buffer, with how many after `step` it dropped (read at once, under
        the lock, so that the count and the records agree)."""
        with self._lock:
            if not self._records:
                return StepPage([], None, 0)
            first = self._records[0].step
            dropped = max(0, first - max(step + 1, 0))
            if self._records[-1].step <= step:
                return StepPage([], first, 0)
            start = max(0, step + 1 - first)
            return StepPage(list(itertools.islice(self._records, start, None)), first, dropped)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
