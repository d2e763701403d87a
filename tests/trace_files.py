"""The real traces the tests replay: the full ones where present ($SLOTUNE_TRACES, else a shared/traces folder beside
the clone), else the excerpts the repository ships (tests/data/traces: the first rows of each, with their licence),
each with the figures a test checks it against."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FULL = Path(os.environ.get("SLOTUNE_TRACES") or REPO.parent / "shared" / "traces") / "azure2023"
EXCERPTS = REPO / "tests" / "data" / "traces" / "azure2023"


@dataclass(frozen=True)
class Trace:
    path: Path
    rows: int
    mean_rate: float  # requests/s over the trace's span
    prompt_p50: float


def _pick(name: str, full: tuple[int, float, float], excerpt: tuple[int, float, float]) -> Trace:
    path = FULL / f"{name}.csv"
    if path.exists():
        return Trace(path, *full)
    return Trace(EXCERPTS / f"{name}_excerpt.csv", *excerpt)


CONV = _pick("AzureLLMInferenceTrace_conv", (19366, 5.53, 1020), (2000, 4.71, 1032))
CODE = _pick("AzureLLMInferenceTrace_code", (8819, 2.57, 1469), (1000, 1.92, 1469))
