"""The engine's knobs, described once: name, type, range or choices, unit, vLLM flag, short label, and how a live
change is applied. Everything that lists or checks knobs derives from this table: the engine's config validation,
the policy schema, the command-line flags, the knob gauges of the metrics, the vLLM export and the labels of the
tuner's reports and the dashboard.

Standard library only, so the load generator's, the tuner's and the dashboard's processes can read it without torch.
Rules between knobs (``max_num_seqs <= max_num_batched_tokens``, the KV pool holding one longest sequence) belong to
``EngineConfig.validate``, which knows the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

Applied = Literal["next_step", "relayout", "load_time"]


@dataclass(frozen=True)
class Knob:
    """One knob. ``low``/``high`` bound a number (``high=None``: unbounded, or bounded by the model at run time);
    ``low_open`` excludes ``low``; ``choices`` lists a name knob's values; ``optional`` allows None ("auto")."""

    name: str
    type: type
    default: Any
    help: str
    label: str  # short name for tables and hover texts
    # "relayout": the KV cache is laid out anew (running sequences recomputed); "load_time": chosen when the engine
    # starts (an update may repeat the value, not change it)
    applied: Applied = "next_step"
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] | None = None
    optional: bool = False
    unit: str = ""
    vllm_flag: str | None = None  # the `vllm serve` flag of the same knob
    vllm_cpu_multiple: int | None = None  # vLLM's CPU build takes only multiples of this (its attention kernel)
    vllm_note: str | None = None  # said in the vLLM export when the knob has no flag and is not at its default

    @property
    def numeric(self) -> bool:
        return self.type in (int, float)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def allowed(self, high: float | None = None, typed: bool = True) -> str:
        """What the knob accepts, as a phrase: "must be an integer in 1..256" (`typed`: naming the type, for a
        value of the wrong type) or "must be in 1..256" (for a number out of range); `high` overrides the table's."""
        high = self.high if high is None else high
        if self.type is bool:
            return "must be true or false"
        if self.choices is not None:
            names = [repr(c) for c in self.choices]
            return f"must be {' or '.join(names)}" if len(names) == 2 else f"must be one of {', '.join(names)}"
        kind = ("a number " if self.type is float else "an integer ") if typed else ""
        if self.type is float:
            top = "inf)" if high is None else f"{high:g}]"
            return f"must be {kind}in {'(' if self.low_open else '['}{self.low:g}, {top}"
        if high is None:
            return f"must be {kind}>= {self.low:g}"
        return f"must be {kind}in {self.low:g}..{high:g}"

    def check(self, value: Any, high: float | None = None) -> str | None:
        """None when `value` is allowed, else why not (`allowed`'s phrase). Booleans are never numbers."""
        if value is None and self.optional:
            return None
        if self.type is bool:
            return None if isinstance(value, bool) else self.allowed(high)
        if self.choices is not None:
            return None if isinstance(value, str) and value in self.choices else self.allowed(high)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                self.type is int and not isinstance(value, int)):
            return self.allowed(high)
        high = self.high if high is None else high
        low = -math.inf if self.low is None else self.low
        if not math.isfinite(value) or value < low or (self.low_open and value == low) or (
                high is not None and value > high):
            return self.allowed(high, typed=False)
        return None

    def parse(self, text: str) -> Any:
        """A value from a command line (``none``/``auto`` for an optional knob); ValueError says what is expected.
        The value is typed, not range-checked: `check` does that."""
        raw = text.strip()
        if self.optional and raw.lower() in ("none", "auto", ""):
            return None
        if self.type is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"expected true or false, got {raw!r}")
        if self.type is str:
            return raw
        try:
            return self.type(raw)
        except ValueError:
            kind = "an integer" if self.type is int else "a number"
            raise ValueError(f"expected {kind}, got {raw!r}") from None

    def as_number(self, value: Any) -> float:
        """The value as a gauge reads it: a choice's index, 1/0 for a bool, the number itself."""
        if self.choices is not None:
            return float(self.choices.index(value)) if value in self.choices else -1.0
        return float(value)

    def from_number(self, number: float) -> Any:
        """`as_number` undone (what the dashboard does with a knob gauge)."""
        if self.choices is not None:
            index = int(number)
            return self.choices[index] if 0 <= index < len(self.choices) else None
        if self.type is bool:
            return number != 0
        return int(number) if self.type is int and float(number).is_integer() else number


KNOBS: tuple[Knob, ...] = (
    Knob("max_num_seqs", int, 64, "most sequences in the running set", "seqs", low=1, unit="sequences",
         vllm_flag="--max-num-seqs"),
    Knob("max_num_batched_tokens", int, 512, "token budget of one step (prefill + decode)", "budget", low=1,
         unit="tokens", vllm_flag="--max-num-batched-tokens"),
    Knob("chunk_size", int, None, "most prefill tokens one sequence may take in one step (none: the step budget)",
         "chunk", low=1, optional=True, unit="tokens", vllm_flag="--long-prefill-token-threshold"),
    Knob("prefill_token_ratio", float, 1.0, "share of the step budget prefill chunks may use (1.0: no cap)", "ratio",
         low=0.0, high=1.0, low_open=True, vllm_note="has no vLLM flag (vLLM: no cap, 1.0)"),
    Knob("block_size", int, 16, "tokens per KV block", "block", "relayout", low=1, high=256, unit="tokens",
         vllm_flag="--block-size", vllm_cpu_multiple=32),
    Knob("num_kv_blocks", int, None, "KV pool size in blocks (none: from kv_cache_bytes)", "blocks", "relayout",
         low=1, optional=True, unit="blocks", vllm_flag="--num-gpu-blocks-override"),
    Knob("kv_cache_bytes", int, 1 << 30, "KV pool size in bytes (when num_kv_blocks is none)", "kv_bytes",
         "relayout", low=1, unit="bytes", vllm_note="sizes the KV pool here; on a GPU size it with "
                                                   "--gpu-memory-utilization"),
    Knob("max_model_len", int, None, "longest prompt + output of a request (none: the model's context)", "len",
         "relayout", low=2, optional=True, unit="tokens", vllm_flag="--max-model-len"),
    Knob("preemption_mode", str, "recompute", "what preemption does with a sequence's blocks", "preempt",
         choices=("recompute", "swap"), vllm_note="vLLM v1 preempts by recompute only"),
    Knob("swap_space_bytes", int, 512 << 20, "host pool for swapped-out blocks", "swap", "relayout", low=0,
         unit="bytes"),
    Knob("enable_prefix_caching", bool, True, "reuse cached prefix blocks", "prefix",
         vllm_flag="--enable-prefix-caching"),
    Knob("scheduling_policy", str, "fcfs", "order of admission", "policy", choices=("fcfs", "priority"),
         vllm_flag="--scheduling-policy"),
    Knob("kernel_backend", str, "auto", "kernels of the layer ops (auto: by device and dtype)", "kernels",
         "load_time", choices=("auto", "torch", "cpp", "triton"), vllm_note="picks slotune's kernels; vLLM has its own"),
)
KNOB_BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}
KNOB_NAMES: tuple[str, ...] = tuple(KNOB_BY_NAME)
# Knobs that need the KV cache laid out anew when they change (running sequences are recomputed).
RELAYOUT_KNOBS = frozenset(k.name for k in KNOBS if k.applied == "relayout")
LOAD_TIME_KNOBS = frozenset(k.name for k in KNOBS if k.applied == "load_time")


def knob(name: str) -> Knob:
    """The knob called `name`; KeyError names the known ones."""
    try:
        return KNOB_BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown knob {name!r}; known knobs: {', '.join(KNOB_NAMES)}") from None


def engine_flag(k: Knob, engine: str) -> str | None:
    """The command-line flag of knob ``k`` on ``engine`` ("slotune" or "vllm"; None: that engine has no such flag)."""
    if engine == "slotune":
        return k.flag
    if engine == "vllm":
        return k.vllm_flag
    raise ValueError(f"unknown engine {engine!r}: slotune or vllm")


def vllm_cpu_refuses(k: Knob, value: Any) -> str | None:
    """Why vLLM's CPU build refuses ``value`` for knob ``k`` (None: it takes it, or has no rule for it)."""
    m = k.vllm_cpu_multiple
    if m is not None and isinstance(value, int) and value % m:
        return f"vLLM's CPU build takes only multiples of {m}"
    return None


def flag_words(flag: str, value: Any, negate_bools: bool = True) -> list[str]:
    """A knob's value on a command line: ``--flag value`` (None as ``none``); a bool as ``--flag`` / ``--no-flag``
    (vLLM's style), or as ``--flag true|false`` (``slotune serve``'s, ``negate_bools=False``)."""
    if isinstance(value, bool):
        if not negate_bools:
            return [flag, str(value).lower()]
        return [flag if value else "--no-" + flag.removeprefix("--")]
    return [flag, "none" if value is None else str(value)]


# The knobs a report line shows by default (the scheduling knobs the tuner searches).
REPORTED_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "block_size", "prefill_token_ratio",
                  "preemption_mode")


def short_knobs(knobs: dict[str, Any], names: list[str] | None = None) -> str:
    """``seqs=8 budget=128 ...``: the knobs by their short labels."""
    return " ".join(f"{short_label(k)}={knobs[k]}" for k in names or REPORTED_KNOBS if k in knobs)


def short_label(name: str) -> str:
    return KNOB_BY_NAME[name].label if name in KNOB_BY_NAME else name


def axis_label(name: str) -> str:
    """A knob's name with its unit, for an axis title."""
    unit = KNOB_BY_NAME[name].unit if name in KNOB_BY_NAME else ""
    return f"{name} ({unit})" if unit else name
