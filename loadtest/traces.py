"""Trace workloads: rows of a real trace in time order, with their own arrival times.

- Azure CSV traces (``TIMESTAMP, ContextTokens, GeneratedTokens``).
- Mooncake JSONL traces (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``): rows with equal
  leading hash ids get identical leading prompt tokens (one block of 512 tokens per id, scaled by the length scale).

:func:`loadtest.workloads.open_workload` opens them by file name; a trace file is parsed once per version.
"""

from __future__ import annotations

import csv
import functools
import itertools
import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterator

from loadtest.tokens import BLOCK, UNIQUE, Segment
from loadtest.workloads import LengthOptions, RequestSpec, Workload

MOONCAKE_BLOCK_TOKENS = 512


@dataclass
class TraceRow:
    time: float  # seconds since the trace's first row
    prompt: int
    output: int
    hash_ids: list[int] = field(default_factory=list)


@functools.lru_cache(maxsize=8)
def _timeline(read_rows: Callable[[str], list[TraceRow]], path: str, mtime_ns: int, size: int) -> tuple[TraceRow, ...]:
    """A trace file's rows in time order, times from its first row; parsed once per file version (a tune screen
    builds a schedule per simulated window: parsing the 19,366-row Azure trace each time took most of its time).
    The rows are shared: a workload never changes them (start_at makes new ones)."""
    rows = sorted(read_rows(path), key=lambda r: r.time)
    t_first = rows[0].time if rows else 0.0
    return tuple(TraceRow(r.time - t_first, r.prompt, r.output, r.hash_ids) for r in rows)


class TraceWorkload(Workload):
    """Rows of a trace in time order, with their own arrival times. Used with other arrival processes, the
    rows give only the lengths and are taken in order (wrapping around at the end)."""

    has_timestamps = True
    fmt = "trace"

    def __init__(self, path: str, lengths: LengthOptions | None = None, seed: int = 0, offset_s: float = 0.0) -> None:
        super().__init__(lengths, seed)
        self.path = str(path)
        stat = os.stat(self.path)
        self.rows = list(_timeline(type(self).read_rows, self.path, stat.st_mtime_ns, stat.st_size))
        if not self.rows:
            raise ValueError(f"trace {path} has no rows")
        self.offset_s = 0.0
        self.start_at(offset_s)
        self.name = os.path.basename(self.path)

    def start_at(self, offset_s: float) -> None:
        """Skip the first ``offset_s`` seconds of the rows' timeline (which then starts at that point: the gap to
        the first row kept is the trace's own)."""
        if not offset_s:
            return
        kept = [TraceRow(r.time - offset_s, r.prompt, r.output, r.hash_ids) for r in self.rows if r.time >= offset_s]
        if not kept:
            raise ValueError(f"trace {self.path} has no rows after offset {self.offset_s + offset_s}s")
        self.rows = kept
        self.offset_s += offset_s

    @staticmethod
    def read_rows(path: str) -> list[TraceRow]:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def span_s(self) -> float:
        return self.rows[-1].time - self.rows[0].time

    @property
    def mean_rate(self) -> float:
        """Requests per second of the trace's own timeline (rows / span, with n-1 gaps over the span)."""
        n = len(self.rows)
        return (n - 1) / self.span_s if n > 1 and self.span_s > 0 else float("nan")

    def _spec(self, index: int, row: TraceRow) -> RequestSpec:
        p, o = self._lengths(row.prompt, row.output)
        return RequestSpec(index, p, o, self.fmt, ((UNIQUE, index, p),), trace_time=row.time)

    def specs(self) -> Iterator[RequestSpec]:
        for index, row in enumerate(itertools.chain.from_iterable(itertools.repeat(self.rows))):
            yield self._spec(index, row)

    def describe(self) -> dict:
        return {**super().describe(), "workload": self.path, "format": self.fmt, "trace_rows": len(self.rows),
                "trace_span_s": self.span_s, "trace_rate_rps": self.mean_rate, "trace_offset_s": self.offset_s}


def _parse_azure_time(text: str) -> float:
    s = text.strip()
    try:
        return float(s)  # some traces give seconds
    except ValueError:
        pass
    # "2023-11-16 18:17:03.9799600": 7 fractional digits; keep them all (fromisoformat stops at microseconds)
    head, dot, frac = s.partition(".")
    base = datetime.fromisoformat(head).replace(tzinfo=timezone.utc).timestamp()  # UTC: no DST jumps
    return base + (float("0." + frac.rstrip("Z")) if dot and frac else 0.0)


class AzureTraceWorkload(TraceWorkload):
    """Azure LLM inference trace CSV: ``TIMESTAMP, ContextTokens, GeneratedTokens``."""

    fmt = "azure-csv"

    @staticmethod
    def read_rows(path: str) -> list[TraceRow]:
        rows = []
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            cols = {c.strip().lower(): c for c in (reader.fieldnames or [])}
            try:
                ts, ctx, gen = cols["timestamp"], cols["contexttokens"], cols["generatedtokens"]
            except KeyError:
                raise ValueError(f"{path}: expected columns TIMESTAMP, ContextTokens, GeneratedTokens, "
                                 f"got {reader.fieldnames}") from None
            for line in reader:
                rows.append(TraceRow(_parse_azure_time(line[ts]), int(line[ctx]), int(line[gen])))
        return rows


class MooncakeTraceWorkload(TraceWorkload):
    """Mooncake trace JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``.

    The prompt is the blocks of its hash ids in order (``512 * length_scale`` tokens each, the same tokens for
    the same id), cut to the scaled input length and, if the ids cover less, completed with unique tokens."""

    fmt = "mooncake-jsonl"

    def __init__(self, path: str, lengths: LengthOptions | None = None, seed: int = 0, offset_s: float = 0.0,
                 block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
        super().__init__(path, lengths, seed, offset_s)
        self.block_len = max(1, int(round(block_tokens * self.lengths.length_scale)))

    @staticmethod
    def read_rows(path: str) -> list[TraceRow]:
        rows = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    rows.append(TraceRow(float(d["timestamp"]) / 1000.0, int(d["input_length"]),
                                         int(d["output_length"]), [int(h) for h in d.get("hash_ids", [])]))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: not a Mooncake row ({e})") from None
        return rows

    def _spec(self, index: int, row: TraceRow) -> RequestSpec:
        p, o = self._lengths(row.prompt, row.output)
        segs: list[Segment] = []
        covered = 0
        for h in row.hash_ids:
            if covered >= p:
                break
            segs.append((BLOCK, h, self.block_len))
            covered += self.block_len
        if covered < p:
            segs.append((UNIQUE, index, p - covered))
        return RequestSpec(index, p, o, self.fmt, tuple(segs), trace_time=row.time)
