"""Workloads: what each request asks for (prompt length, output length, shared prefix), in order.

- ``mixed``: short / medium / long classes, 6:3:1 by default, each with a fixed length or a LO-HI range.
- Azure CSV traces (``TIMESTAMP, ContextTokens, GeneratedTokens``), with their own arrival times.
- Mooncake JSONL traces (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``): rows with equal
  leading hash ids get identical leading prompt tokens (one block of 512 tokens per id, scaled by the length scale).
- ``prefix``: groups of requests sharing a system prompt, each with its own suffix.

Every workload applies the same length options (a length scale for prompts and one for outputs, clipping to the
model's context) and yields :class:`RequestSpec` objects, which say which segments make the prompt
(see :mod:`loadtest.tokens`) but hold no tokens: tokens are drawn when the request is sent.
Arrival times come from :mod:`loadtest.arrivals`; :mod:`loadtest.schedule` puts the two together.
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

import numpy as np

from loadtest.tokens import BLOCK, GROUP, UNIQUE, Segment

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload. ``at`` is its intended send time in seconds from the start of the run
    (set by the schedule); ``trace_time`` is the arrival time the trace itself gives (seconds from its first row)."""

    index: int
    prompt_len: int
    output_len: int
    kind: str
    segments: tuple[Segment, ...]
    at: float = 0.0
    trace_time: float | None = None

    def to_wire(self) -> list:
        return [self.index, self.at, self.prompt_len, self.output_len, self.kind, [list(s) for s in self.segments]]

    @classmethod
    def from_wire(cls, w: list) -> "RequestSpec":
        index, at, p, o, kind, segs = w
        return cls(int(index), int(p), int(o), str(kind), tuple((int(s[0]), int(s[1]), int(s[2])) for s in segs), float(at))


@dataclass(frozen=True)
class LengthOptions:
    """Length scale (prompts; outputs too unless ``output_scale`` is given) and clipping to the context.

    Scaled lengths are rounded and at least 1. With ``max_context`` set, a request keeps
    ``prompt + output <= max_context``: the output is cut to ``max_context - 1`` first, then the prompt.
    """

    length_scale: float = 1.0
    output_scale: float | None = None
    max_context: int | None = None

    def __post_init__(self) -> None:
        if not self.length_scale > 0 or (self.output_scale is not None and not self.output_scale > 0):
            raise ValueError("length scales must be > 0")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError("max_context must be >= 2")

    @property
    def out_scale(self) -> float:
        return self.length_scale if self.output_scale is None else self.output_scale

    def scale_prompt(self, n: int | float) -> int:
        return max(1, int(round(n * self.length_scale)))

    def scale_output(self, n: int | float) -> int:
        return max(1, int(round(n * self.out_scale)))

    def clip(self, prompt: int, output: int) -> tuple[int, int, bool]:
        if self.max_context is None or prompt + output <= self.max_context:
            return prompt, output, False
        output = min(output, self.max_context - 1)
        prompt = min(prompt, self.max_context - output)
        return prompt, output, True

    def describe(self) -> dict:
        return {"length_scale": self.length_scale, "output_scale": self.out_scale, "max_context": self.max_context}


def _parse_range(text: str) -> tuple[int, int]:
    """``"128"`` -> (128, 128); ``"64-256"`` -> (64, 256)."""
    s = str(text).strip()
    lo, _, hi = s.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"length must be N or LO-HI, got {text!r}") from None
    if not 1 <= a <= b:
        raise ValueError(f"length range must satisfy 1 <= LO <= HI, got {text!r}")
    return a, b


def _draw(rng: np.random.Generator, r: tuple[int, int]) -> int:
    return r[0] if r[0] == r[1] else int(rng.integers(r[0], r[1] + 1))


class Workload:
    """Base: an (often endless) sequence of RequestSpecs with index 0, 1, 2, ..."""

    name = "workload"
    has_timestamps = False  # True for traces that carry their own arrival times

    def __init__(self, lengths: LengthOptions | None = None, seed: int = 0) -> None:
        self.lengths = lengths or LengthOptions()
        self.seed = seed
        self.clipped = 0

    def specs(self) -> Iterator[RequestSpec]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _lengths(self, prompt: float, output: float) -> tuple[int, int]:
        """Scale unscaled lengths, then clip."""
        return self._clip(self.lengths.scale_prompt(prompt), self.lengths.scale_output(output))

    def _clip(self, prompt: int, output: int) -> tuple[int, int]:
        p, o, clipped = self.lengths.clip(prompt, output)
        self.clipped += clipped
        return p, o

    def describe(self) -> dict:
        return {"workload": self.name, **self.lengths.describe(), "seed": self.seed}


# ---------------------------------------------------------------------------------------------- mixed

@dataclass(frozen=True)
class LengthClass:
    name: str
    prompt: tuple[int, int]
    output: tuple[int, int]
    weight: int


DEFAULT_MIX = "short=128:32,medium=512:128,long=2048:256"
DEFAULT_MIX_WEIGHTS = "6:3:1"


def parse_mix(mix: str = DEFAULT_MIX, weights: str = DEFAULT_MIX_WEIGHTS) -> list[LengthClass]:
    """``"short=128:32,medium=512:128,long=1024-4096:256"`` with ``"6:3:1"`` -> LengthClasses
    (``name=PROMPT:OUTPUT``, each length ``N`` or ``LO-HI``; integer weights, one per class)."""
    items = [x.strip() for x in str(mix).split(",") if x.strip()]
    ws = [x.strip() for x in str(weights).split(":") if x.strip()]
    if len(items) != len(ws):
        raise ValueError(f"mix has {len(items)} classes but weights {weights!r} give {len(ws)}")
    classes = []
    for item, w in zip(items, ws):
        name, eq, lengths = item.partition("=")
        prompt, colon, output = lengths.partition(":")
        if not eq or not colon or not name:
            raise ValueError(f"mix class must be NAME=PROMPT:OUTPUT, got {item!r}")
        if not w.isdigit() or int(w) < 0:
            raise ValueError(f"mix weights must be non-negative integers, got {weights!r}")
        classes.append(LengthClass(name.strip(), _parse_range(prompt), _parse_range(output), int(w)))
    if sum(c.weight for c in classes) == 0:
        raise ValueError("mix weights must not all be 0")
    return classes


class MixedWorkload(Workload):
    """Classes in exact proportion: every consecutive block of ``sum(weights)`` requests (10 for 6:3:1) holds
    each class exactly ``weight`` times, in a seeded random order. Each prompt is unique (no shared prefix)."""

    name = "mixed"

    def __init__(self, classes: list[LengthClass] | None = None, lengths: LengthOptions | None = None,
                 seed: int = 0) -> None:
        super().__init__(lengths, seed)
        self.classes = classes or parse_mix()

    def specs(self) -> Iterator[RequestSpec]:
        rng = np.random.default_rng([self.seed, 1])
        deck = [c for c in self.classes for _ in range(c.weight)]
        for block in itertools.count():
            order = rng.permutation(len(deck))
            for j, k in enumerate(order):
                c = deck[k]
                index = block * len(deck) + j
                p, o = self._lengths(_draw(rng, c.prompt), _draw(rng, c.output))
                yield RequestSpec(index, p, o, c.name, ((UNIQUE, index, p),))

    def describe(self) -> dict:
        mix = {c.name: {"prompt": list(c.prompt), "output": list(c.output), "weight": c.weight} for c in self.classes}
        return {**super().describe(), "mix": mix}


# ---------------------------------------------------------------------------------------------- prefix

class PrefixWorkload(Workload):
    """``groups`` system prompts of ``prefix_len`` tokens; each request picks a group (seeded, uniform) and adds
    its own ``suffix_len`` tokens. The prefix is scaled by the length scale like any prompt length."""

    name = "prefix"

    def __init__(self, groups: int = 8, prefix_len: str | tuple[int, int] = "1024", suffix_len: str | tuple = "128",
                 output_len: str | tuple = "64", lengths: LengthOptions | None = None, seed: int = 0) -> None:
        super().__init__(lengths, seed)
        if groups < 1:
            raise ValueError("prefix workload needs at least one group")
        self.groups = groups
        self.prefix = prefix_len if isinstance(prefix_len, tuple) else _parse_range(prefix_len)
        self.suffix = suffix_len if isinstance(suffix_len, tuple) else _parse_range(suffix_len)
        self.output = output_len if isinstance(output_len, tuple) else _parse_range(output_len)
        grng = np.random.default_rng([seed, 2])
        self.group_prefix = [self.lengths.scale_prompt(_draw(grng, self.prefix)) for _ in range(groups)]

    def specs(self) -> Iterator[RequestSpec]:
        rng = np.random.default_rng([self.seed, 3])
        for index in itertools.count():
            g = int(rng.integers(0, self.groups))
            pre = self.group_prefix[g]
            suffix = self.lengths.scale_prompt(_draw(rng, self.suffix))
            p, o = self._clip(pre + suffix, self.lengths.scale_output(_draw(rng, self.output)))
            yield RequestSpec(index, p, o, f"group{g}", ((GROUP, g, pre), (UNIQUE, index, max(p - pre, 0))))

    def describe(self) -> dict:
        return {**super().describe(), "groups": self.groups, "prefix_len": list(self.prefix),
                "suffix_len": list(self.suffix), "output_len": list(self.output)}


# ---------------------------------------------------------------------------------------------- traces

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


# ---------------------------------------------------------------------------------------------- factory

SYNTHETIC_WORKLOADS = ("mixed", "prefix")


def is_trace(name: str) -> bool:
    """A workload name that is a trace file (everything but the synthetic workloads)."""
    return name not in SYNTHETIC_WORKLOADS


def open_workload(name: str, lengths: LengthOptions | None = None, seed: int = 0, *, mix: str = DEFAULT_MIX,
                  mix_weights: str = DEFAULT_MIX_WEIGHTS, prefix_groups: int = 8, prefix_len: str = "1024",
                  suffix_len: str = "128", prefix_output_len: str = "64", trace_offset_s: float = 0.0) -> Workload:
    """``mixed``, ``prefix``, or a trace path (``.csv``: Azure; ``.jsonl``/``.json``: Mooncake)."""
    if name == "mixed":
        return MixedWorkload(parse_mix(mix, mix_weights), lengths, seed)
    if name == "prefix":
        return PrefixWorkload(prefix_groups, prefix_len, suffix_len, prefix_output_len, lengths, seed)
    if not os.path.exists(name):
        raise ValueError(f"workload must be 'mixed', 'prefix' or an existing trace file, got {name!r}")
    lower = name.lower()
    if lower.endswith(".csv"):
        return AzureTraceWorkload(name, lengths, seed, trace_offset_s)
    if lower.endswith((".jsonl", ".json")):
        return MooncakeTraceWorkload(name, lengths, seed, trace_offset_s)
    raise ValueError(f"trace {name!r}: expected .csv (Azure) or .jsonl (Mooncake)")

