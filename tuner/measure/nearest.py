"""The nearest targets a machine meets, and the capacity there.

Where no config was shown to serve any rate at the SLO asked for (or the machine's floor is above it), saying which
target binds is half an answer: a serving engineer also wants to know what would be served, and at which targets.
A measurement's :class:`~tuner.measure.targets.Reached` gives, for each target on its own, the value the target
share of its requests reached, with an interval on the measurement's blocks. The nearest SLO this machine meets
raises each target those requests did not meet to the upper end of that interval (rounded up to two significant
figures, so that it reads as a target a person would write) and keeps the others. A capacity search at that SLO,
judged as any other (its probes at their Bonferroni share of the level), then says what the machine serves there.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

from slotune.slo import SLO
from tuner.measure.capacity import Capacity, CapacitySearcher
from tuner.measure.targets import Reached

UNBOUNDED_RAISE = 1.5  # a reached value whose interval has no upper end: the target is raised to this times it


def round_up(x: float, digits: int = 2) -> float:
    """``x`` rounded up to ``digits`` significant figures (0.0612 -> 0.062, 9.61 -> 9.7)."""
    if x <= 0 or not math.isfinite(x):
        return x
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.ceil(x * scale - 1e-9) / scale


def nearest_slo(slo: SLO, reached: Reached) -> SLO | None:
    """``slo`` with each TBT/TTFT target that the target share of the requests did not reach (the point estimate of
    the value they reached is above it) raised to where they did (the upper end of its interval, rounded up); None when no target needs raising or a target was never reached
    (requests never answered: no finite target would be met)."""
    raised: dict[str, float] = {}
    for name, target, value in (("tbt_p99", slo.tbt_p99, reached.tbt), ("ttft_p99", slo.ttft_p99, reached.ttft)):
        if target is None or not value.n or value.value <= target:
            continue  # met by the target share of these requests (its interval may still be open above)
        if not math.isfinite(value.value):
            return None
        high = value.high if math.isfinite(value.high) else UNBOUNDED_RAISE * value.value
        raised[name] = max(target, round_up(high))
    return replace(slo, **raised) if raised else None


def relaxation(slo: SLO, nearer: SLO) -> float:
    """How far ``nearer`` is from ``slo``: the product of its targets' ratios (1.0: the same targets)."""
    out = 1.0
    for a, b in zip(slo.as_dict().values(), nearer.as_dict().values()):
        if a is not None and b is not None:
            out *= b / a
    return out


@contextmanager
def judged_at(backend: Any, slo: SLO) -> Iterator[None]:
    """``backend`` (a trial runner) judges its measurements at ``slo`` inside the block, at its own SLO again after."""
    own = backend.slo
    backend.slo = slo
    try:
        yield
    finally:
        backend.slo = own


@dataclass
class NearestCapacity:
    """A config's capacity at the nearest SLO this machine meets."""

    slo: SLO
    asked: SLO
    source: str  # where the nearest targets were read: "one request at a time", "at 0.33 req/s"
    capacity: Capacity

    def as_dict(self) -> dict[str, Any]:
        return {"slo": self.slo.as_dict(), "asked": self.asked.as_dict(), "source": self.source,
                "capacity": self.capacity.as_dict()}


def search_nearest(searcher: CapacitySearcher, asked: SLO, nearer: SLO, source: str, knobs: dict[str, Any],
                   out_dir: Path, start: float | None = None) -> NearestCapacity:
    """``knobs``' capacity searched at ``nearer`` (:func:`nearest_slo` of ``asked``), from ``start`` req/s."""
    with judged_at(searcher.backend, nearer):
        cap = searcher.search(knobs, out_dir, start=start)
    return NearestCapacity(nearer, asked, source, cap)
