"""One record per request, and the table they are written to (parquet, or CSV).

Times: ``intended_send_time``, ``actual_send_time``, ``finish_time`` and every entry of ``token_times`` are
Unix epoch seconds (float64, sub-microsecond resolution), so they line up with the engine's step records;
``scheduled_at`` is the intended send time as an offset from the start of the run; ``ttft`` counts from the
intended send time (open loop: a late send does not hide the wait).

Status: ``ok`` (the stream ended normally), ``error`` (HTTP error, connection error, timeout, malformed stream),
``unfinished`` (still streaming when the run ended; its tokens so far are kept), ``not_sent`` (its intended
time had passed when the run was stopped, and the generator had not sent it yet).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

NAN = float("nan")


@dataclass
class RequestRecord:
    index: int
    id: str = ""
    worker: int = 0
    kind: str = ""
    scheduled_at: float = 0.0
    intended_send_time: float = 0.0
    actual_send_time: float = NAN
    prompt_tokens: int = 0
    max_tokens: int = 0
    output_tokens: int = 0
    ttft: float = NAN
    token_times: list[float] = field(default_factory=list)
    finish_time: float = NAN
    status: str = "ok"
    error: str = ""
    http_status: int = 0
    output_events: int = 0  # the events the output tokens came in (fewer than the tokens: several in one event)
    multi_token_events: int = 0  # events that carried more than one token
    usage_tokens: int = -1  # completion_tokens of the server's usage (-1: it sent none)

    @property
    def send_lag(self) -> float:
        """Actual minus intended send time (NaN if never sent)."""
        return self.actual_send_time - self.intended_send_time

    def to_dict(self) -> dict[str, Any]:
        # by hand: dataclasses.asdict deep-copies token_times, milliseconds per record in the load process
        d = {name: getattr(self, name) for name in _FIELDS}
        d["token_times"] = list(self.token_times)
        d["send_lag"] = self.send_lag
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestRecord":
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            if f.name == "token_times":
                v = json.loads(v) if isinstance(v, str) else [float(x) for x in (v if v is not None else [])]
            elif f.name in ("error", "id", "kind", "status"):
                v = "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
            elif f.name == "usage_tokens":
                v = -1 if v is None or v == "" or (isinstance(v, float) and math.isnan(v)) else int(v)
            elif f.name in ("index", "worker", "prompt_tokens", "max_tokens", "output_tokens", "http_status",
                            "output_events", "multi_token_events"):
                v = 0 if v is None or v == "" or (isinstance(v, float) and math.isnan(v)) else int(v)
            else:
                v = NAN if v is None or v == "" else float(v)
            kw[f.name] = v
        return cls(**kw)


_FIELDS = [f.name for f in dataclasses.fields(RequestRecord)]
COLUMNS = _FIELDS + ["send_lag"]


def _arrow_schema():
    import pyarrow as pa

    types = {
        "index": pa.int64(), "id": pa.string(), "worker": pa.int32(), "kind": pa.string(),
        "scheduled_at": pa.float64(), "intended_send_time": pa.float64(), "actual_send_time": pa.float64(),
        "prompt_tokens": pa.int64(), "max_tokens": pa.int64(), "output_tokens": pa.int64(),
        "ttft": pa.float64(), "token_times": pa.list_(pa.float64()), "finish_time": pa.float64(),
        "status": pa.string(), "error": pa.string(), "http_status": pa.int32(), "output_events": pa.int64(),
        "multi_token_events": pa.int64(), "usage_tokens": pa.int64(), "send_lag": pa.float64(),
    }
    return pa.schema([(c, types[c]) for c in COLUMNS])


def write_records(path: str, records: Iterable[RequestRecord], meta: dict | None = None) -> str:
    """Write records sorted by index, as parquet (``.parquet``) or CSV (``.csv``, token times as a JSON list).
    ``meta`` goes into the parquet file's metadata (key ``slotune``). Returns the path."""
    rows = sorted(records, key=lambda r: r.index)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".csv"):
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            for r in rows:
                d = r.to_dict()
                d["token_times"] = json.dumps(d["token_times"])
                w.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()})
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _arrow_schema()
    cols: dict[str, list[Any]] = {c: [] for c in COLUMNS}
    for r in rows:
        d = r.to_dict()
        for c in COLUMNS:
            cols[c].append(d[c])
    table = pa.table(cols, schema=schema)
    if meta is not None:
        table = table.replace_schema_metadata({"slotune": json.dumps(meta, default=str)})
    pq.write_table(table, path)
    return path


def read_records(path: str) -> list[RequestRecord]:
    """Records from a parquet or CSV file written by :func:`write_records`."""
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            return [RequestRecord.from_dict(d) for d in csv.DictReader(f)]
    import pyarrow.parquet as pq

    return [RequestRecord.from_dict(d) for d in pq.read_table(path).to_pylist()]


def to_frame(records: Iterable[RequestRecord]):
    """A pandas DataFrame with one row per request (``token_times`` as lists)."""
    import pandas as pd

    return pd.DataFrame([r.to_dict() for r in records], columns=COLUMNS)


def from_frame(df) -> list[RequestRecord]:
    return [RequestRecord.from_dict(d) for d in df.to_dict("records")]
