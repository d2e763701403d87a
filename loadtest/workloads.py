"""Workloads: what each request asks for (prompt length, output length, shared prefix), in order.

- ``mixed``: short / medium / long classes, 6:3:1 by default, each with a fixed length or a LO-HI range.
- traces, with their own arrival times (:mod:`loadtest.traces`): Azure CSV and Mooncake JSONL.
- ``prefix``: groups of requests sharing a system prompt, each with its own suffix.

Every workload applies the same length options (a length scale for prompts and one for outputs, clipping to the
model's context) and yields :class:`RequestSpec` objects, which say which segments make the prompt
(see :mod:`loadtest.tokens`) but hold no tokens: tokens are drawn when the request is sent.
Arrival times come from :mod:`loadtest.arrivals`; :mod:`loadtest.schedule` puts the two together.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from loadtest.tokens import GROUP, UNIQUE, Segment


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
    from loadtest.traces import AzureTraceWorkload, MooncakeTraceWorkload  # traces build on this module

    if lower.endswith(".csv"):
        return AzureTraceWorkload(name, lengths, seed, trace_offset_s)
    if lower.endswith((".jsonl", ".json")):
        return MooncakeTraceWorkload(name, lengths, seed, trace_offset_s)
    raise ValueError(f"trace {name!r}: expected .csv (Azure) or .jsonl (Mooncake)")

