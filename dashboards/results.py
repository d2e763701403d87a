"""Reading the result folders the dashboard draws: sweep folders (`sweep.json`, format slotune-sweep/1) and trial
folders (`trial.json` slotune-trial/1, `summary.json`, `records.parquet`, `steps.jsonl`), as the tuner, the
simulator and `slotune sweep` write them. A folder of an older or unknown format raises `FormatError` with the
reason, which the pages show instead of a graph."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from slotune import result_files as files

SWEEP_FORMAT = "slotune-sweep/1"
TRIAL_FORMAT = "slotune-trial/1"
MAX_SCAN_DEPTH = 4  # how deep under --results the dashboard looks for sweep and trial folders


class FormatError(ValueError):
    """A folder the dashboard cannot read: missing files, unreadable JSON, or another format."""


@dataclass(frozen=True)
class SweepPoint:
    value: Any
    dir: str | None
    summary: dict[str, Any]
    step_stats: dict[str, float]
    feasible: bool
    reason: str | None

    def metric(self, name: str) -> float | None:
        v = self.summary.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(float(v)):
            return None
        return float(v)


@dataclass(frozen=True)
class Sweep:
    path: Path
    knob: str
    values: list[Any]
    fixed: dict[str, Any]
    workload: str
    rate: float | None
    slo: dict[str, float | None]
    simulated: bool
    points: list[SweepPoint]

    @property
    def numeric(self) -> bool:
        return all(isinstance(p.value, (int, float)) and not isinstance(p.value, bool) for p in self.points)

    def sorted_points(self) -> list[SweepPoint]:
        return sorted(self.points, key=lambda p: p.value) if self.numeric else list(self.points)


@dataclass(frozen=True)
class Trial:
    path: Path
    knobs: dict[str, Any]
    step_stats: dict[str, float]
    feasible: bool
    reason: str | None
    workload: str
    rate: float | None
    slo: dict[str, float | None]
    started_at: str
    simulated: bool
    summary: dict[str, Any] = field(default_factory=dict)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FormatError(f"{path.parent}: no {path.name}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FormatError(f"{path}: cannot read it as JSON ({error})") from None


def _check_format(data: Any, path: Path, expected: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise FormatError(f"{path}: expected a JSON object")
    found = data.get("format")
    if found != expected:
        what = f"format {found!r}" if found is not None else "no `format` field (an older format)"
        raise FormatError(f"{path}: {what}; this dashboard reads {expected}")
    return data


def _slo(data: dict[str, Any]) -> dict[str, float | None]:
    slo = data.get("slo") or {}
    return {k: slo.get(k) for k in ("tbt_p99", "ttft_p99", "e2e_p99")} if isinstance(slo, dict) else {}


def workload_name(w: Any) -> str:
    """A workload as the pages show it: its name, and its length scale when not 1 (the tuner writes its
    WorkloadSpec as a dict)."""
    if not isinstance(w, dict):
        return "" if w is None else str(w)
    scale = w.get("length_scale")
    return str(w.get("name", "?")) + (f" (length x{scale:g})" if isinstance(scale, (int, float)) and scale != 1
                                      else "")


def load_sweep(folder: str | Path) -> Sweep:
    folder = Path(folder)
    path = folder / "sweep.json"
    data = _check_format(_read_json(path), path, SWEEP_FORMAT)
    try:
        points = [SweepPoint(value=p["value"], dir=p.get("dir"), summary=dict(p.get("summary") or {}),
                             step_stats=dict(p.get("step_stats") or {}), feasible=bool(p.get("feasible")),
                             reason=p.get("reason")) for p in data["points"]]
        return Sweep(path=folder, knob=str(data["knob"]), values=list(data.get("values") or []),
                     fixed=dict(data.get("fixed") or {}), workload=workload_name(data.get("workload")),
                     rate=data.get("rate"), slo=_slo(data), simulated=bool(data.get("simulated")), points=points)
    except (KeyError, TypeError, AttributeError) as error:
        raise FormatError(f"{path}: missing or malformed field {error}") from None


def load_trial(folder: str | Path) -> Trial:
    folder = Path(folder)
    path = folder / files.TRIAL
    data = _check_format(_read_json(path), path, TRIAL_FORMAT)
    summary_path = folder / files.SUMMARY
    summary = _read_json(summary_path) if summary_path.exists() else {}
    return Trial(path=folder, knobs=dict(data.get("knobs") or {}), step_stats=dict(data.get("step_stats") or {}),
                 feasible=bool(data.get("feasible")), reason=data.get("reason"),
                 workload=workload_name(data.get("workload")), rate=data.get("rate"), slo=_slo(data),
                 started_at=str(data.get("started_at", "")), simulated=bool(data.get("simulated")),
                 summary=summary if isinstance(summary, dict) else {})


def read_steps(folder: str | Path) -> list[dict[str, Any]]:
    """The engine's step records of a trial folder (`steps.jsonl`); [] when the trial has none."""
    path = Path(folder) / files.STEPS
    if not path.exists():
        return []
    steps = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    steps.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise FormatError(f"{path}:{number}: not JSON ({error})") from None
    return steps


def read_request_records(folder: str | Path) -> list[Any]:
    """The load test's per-request records (`records.parquet`, or `records.csv`) as loadtest RequestRecords."""
    from loadtest.records import read_records  # the one reader of the records table

    folder = Path(folder)
    for name in (files.RECORDS, files.RECORDS_CSV):
        if (folder / name).exists():
            try:
                return read_records(str(folder / name))
            except Exception as error:  # pyarrow / csv errors: the page says what is wrong
                raise FormatError(f"{folder / name}: cannot read the records ({error})") from None
    return []


def in_window(records: list[Any], summary: dict[str, Any]) -> list[Any]:
    """The records the summary counted: with a `window` [start, end) (seconds of the schedule; the tuner's trials
    leave out their warm-up this way), those scheduled inside it; otherwise all."""
    window = summary.get("window")
    if not (isinstance(window, list) and len(window) == 2):
        return list(records)
    a, b = float(window[0]), float(window[1])
    return [r for r in records if a <= r.scheduled_at < b]


def find_folders(root: str | Path, marker: str, max_depth: int = MAX_SCAN_DEPTH) -> list[Path]:
    """Folders under `root` (root included) holding the file `marker`, sorted by path."""
    root = Path(root)
    found: list[Path] = []

    def walk(folder: Path, depth: int) -> None:
        if (folder / marker).is_file():
            found.append(folder)
        if depth >= max_depth:
            return
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return
        for child in children:
            walk(child, depth + 1)

    if root.is_dir():
        walk(root, 0)
    return found


def latest_tune_progress(root: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The progress file (``result_files.PROGRESS``) most recently written under ``root`` and what it says; None
    without one (or where it cannot be read)."""
    found = find_folders(root, files.PROGRESS)
    if not found:
        return None
    folder = max(found, key=lambda f: (f / files.PROGRESS).stat().st_mtime)
    try:
        data = json.loads((folder / files.PROGRESS).read_text())
    except (OSError, ValueError):
        return None
    return (folder, data) if isinstance(data, dict) else None
