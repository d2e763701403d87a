"""The options of a load test, shared by ``slotune loadtest`` and the locustfile (whose web UI shows them).

Every option has a flag (``--rate``), an environment variable (``SLOTUNE_RATE``, read by the locustfile) and a
default; values travel as strings and :meth:`LoadConfig.from_strings` turns them into a typed, validated config.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from loadtest.arrivals import KINDS
from slotune.slo import SLO
from slotune.units import parse_duration
from loadtest.tokens import TokenSpace
from loadtest.workloads import DEFAULT_MIX, DEFAULT_MIX_WEIGHTS


@dataclass(frozen=True)
class Option:
    flag: str  # without the leading dashes; the field name is the flag with "-" -> "_"
    default: str
    help: str

    @property
    def field(self) -> str:
        return self.flag.replace("-", "_")

    @property
    def env(self) -> str:
        return "SLOTUNE_" + self.field.upper()


OPTIONS: list[Option] = [
    Option("workload", "mixed", "mixed, prefix, or a trace file: .csv (Azure) or .jsonl (Mooncake)"),
    Option("rate", "", "requests/s (synthetic arrivals; with a trace's own timestamps: rescale the trace to this mean rate)"),
    Option("duration", "60s", "length of the schedule (requests are sent for this long), e.g. 90s, 5m"),
    Option("arrival", "", f"arrival process: {'|'.join(KINDS)} (default: trace for traces, poisson otherwise)"),
    Option("burstiness", "1.0", "gamma arrivals: shape factor (1 = Poisson, <1 burstier; gap CV = 1/sqrt(b))"),
    Option("ramp-to", "", "ramp arrivals: rate at the end (starts at --rate)"),
    Option("time-scale", "", "stretch a trace's timestamps by this factor (2 = half the rate); default 1, or set by --rate"),
    Option("trace-offset", "0s", "skip this much of the trace's beginning"),
    Option("trace-segment-seed", "", "replay the segment of the trace (after --trace-offset) that starts where this "
                                     "seed draws, uniformly among the starts whose --duration fits; default: from "
                                     "the beginning"),
    Option("length-scale", "1.0", "scale prompt (and output) lengths"),
    Option("output-scale", "", "scale output lengths by this instead of --length-scale"),
    Option("max-context", "", "clip prompt+output to this many tokens (the model's context / max_model_len)"),
    Option("max-requests", "", "send at most this many requests"),
    Option("seed", "0", "seed for arrivals, mix order and prompt tokens"),
    Option("mix", DEFAULT_MIX, "mixed workload classes NAME=PROMPT:OUTPUT (each N or LO-HI)"),
    Option("mix-weights", DEFAULT_MIX_WEIGHTS, "mixed workload class weights"),
    Option("prefix-groups", "8", "prefix workload: number of shared system prompts"),
    Option("prefix-len", "1024", "prefix workload: system prompt length (N or LO-HI)"),
    Option("suffix-len", "128", "prefix workload: per-request suffix length (N or LO-HI)"),
    Option("prefix-output-len", "64", "prefix workload: output length (N or LO-HI)"),
    Option("token-range", "100:32000", "prompt token ids are drawn from LOW:HIGH (must fit the model's vocabulary)"),
    Option("model", "", "model name sent in requests (default: the first of GET /v1/models, else none)"),
    Option("slo-p99-tbt", "", "SLO target for p99 time between tokens, e.g. 50ms"),
    Option("slo-p99-ttft", "", "SLO target for p99 time to first token, e.g. 2s"),
    Option("slo-p99-e2e", "", "SLO target for p99 end-to-end latency"),
    Option("drain-timeout", "60s", "after the last send, wait this long for requests still streaming (then: unfinished)"),
    Option("request-timeout", "120s", "a request that receives nothing for this long fails"),
    Option("lag-warn", "10ms", "warn when the generator's send lag p99 exceeds this"),
    Option("out", "", "directory for records and summary (default loadtest-results/<time>)"),
    Option("records-format", "parquet", "records table format: parquet or csv"),
]


def _opt(conv: Callable[[str], Any]) -> Callable[[Any], Any]:
    def f(v: Any) -> Any:
        if v is None or (isinstance(v, str) and not v.strip()):
            return None
        return conv(v.strip() if isinstance(v, str) else v)
    return f


def _pos_float(v: Any) -> float:
    x = float(v)
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"must be > 0, got {v!r}")
    return x


def _pos_int(v: Any) -> int:
    x = int(v)
    if x < 1:
        raise ValueError(f"must be >= 1, got {v!r}")
    return x


_CONVERT: dict[str, Callable[[Any], Any]] = {
    "rate": _opt(_pos_float),
    "duration": _opt(parse_duration),
    "arrival": _opt(str),
    "burstiness": _opt(_pos_float),
    "ramp_to": _opt(float),
    "time_scale": _opt(_pos_float),
    "trace_offset": _opt(parse_duration),
    "trace_segment_seed": _opt(int),
    "length_scale": _opt(_pos_float),
    "output_scale": _opt(_pos_float),
    "max_context": _opt(_pos_int),
    "max_requests": _opt(_pos_int),
    "seed": _opt(int),
    "prefix_groups": _opt(_pos_int),
    "model": _opt(str),
    "slo_p99_tbt": _opt(parse_duration),  # the --slo-p99-* flags fill LoadConfig.slo (SLO_FLAGS)
    "slo_p99_ttft": _opt(parse_duration),
    "slo_p99_e2e": _opt(parse_duration),
    "drain_timeout": _opt(parse_duration),
    "request_timeout": _opt(parse_duration),
    "lag_warn": _opt(parse_duration),
    "out": _opt(str),
}


SLO_FLAGS = {"slo_p99_tbt": "tbt_p99", "slo_p99_ttft": "ttft_p99", "slo_p99_e2e": "e2e_p99"}  # option -> SLO field


@dataclass(frozen=True)
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    workload: str = "mixed"
    rate: float | None = None
    duration: float = 60.0
    arrival: str | None = None
    burstiness: float = 1.0
    ramp_to: float | None = None
    time_scale: float | None = None
    trace_offset: float = 0.0
    trace_segment_seed: int | None = None  # a fresh draw of a trace is another segment of it (trace arrivals only)
    length_scale: float = 1.0
    output_scale: float | None = None
    max_context: int | None = None
    max_requests: int | None = None
    seed: int = 0
    mix: str = DEFAULT_MIX
    mix_weights: str = DEFAULT_MIX_WEIGHTS
    prefix_groups: int = 8
    prefix_len: str = "1024"
    suffix_len: str = "128"
    prefix_output_len: str = "64"
    token_range: str = "100:32000"
    model: str | None = None
    slo: SLO = SLO()  # from the --slo-p99-* flags
    drain_timeout: float = 60.0
    request_timeout: float = 120.0
    lag_warn: float = 0.010
    out: str | None = None
    records_format: str = "parquet"

    def __post_init__(self) -> None:
        if self.arrival is not None and self.arrival not in KINDS:
            raise ValueError(f"arrival must be one of {', '.join(KINDS)}, got {self.arrival!r}")
        if self.records_format not in ("parquet", "csv"):
            raise ValueError(f"records format must be parquet or csv, got {self.records_format!r}")
        if not self.duration > 0:
            raise ValueError("duration must be > 0")
        TokenSpace.parse_range(self.token_range)

    @classmethod
    def from_strings(cls, values: dict[str, Any], url: str | None = None) -> "LoadConfig":
        """Build from option values as given on a command line / in the web UI / in the environment (strings;
        empty means unset, i.e. the default; keys as fields or flags). Unknown keys are ignored. Errors name the flag."""
        values = {str(k).replace("-", "_"): v for k, v in values.items()}
        kwargs: dict[str, Any] = {}
        for o in OPTIONS:
            raw = values.get(o.field)
            if raw is None or (isinstance(raw, str) and not raw.strip()):
                raw = o.default
            if isinstance(raw, str) and not raw.strip():
                continue
            conv = _CONVERT.get(o.field, lambda v: v.strip() if isinstance(v, str) else v)
            try:
                value = conv(raw)
            except ValueError as e:
                raise ValueError(f"--{o.flag}: {e}") from None
            if value is not None:
                kwargs[o.field] = value
        targets = {SLO_FLAGS[k]: kwargs.pop(k) for k in list(kwargs) if k in SLO_FLAGS}
        if url:
            kwargs["url"] = url
        return cls(**kwargs, slo=SLO(**targets))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LoadConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in names}
        if isinstance(values.get("slo"), dict):
            values["slo"] = SLO.from_dict(values["slo"])
        return cls(**values)

    def option(self, field: str) -> Any:
        """The value behind option ``field`` (an SLO flag reads its target)."""
        return getattr(self.slo, SLO_FLAGS[field]) if field in SLO_FLAGS else getattr(self, field)


def to_argv(cfg: LoadConfig) -> list[str]:
    """The config as the locustfile's command-line flags (``--url`` goes as Locust's ``--host``)."""
    argv: list[str] = []
    for o in OPTIONS:
        v = cfg.option(o.field)
        if v is None:
            continue
        argv += [f"--{o.flag}", repr(v) if isinstance(v, float) else str(v)]
    return argv
