"""The SLO, in one shape for every part of slotune: the load generator's summary, the policies, the tuner and the
controller all take this record, and none converts it into another.

A request attains the SLO when its TTFT is within ``ttft_p99`` (when set), the 99th percentile of its own gaps within
``tbt_p99``, and its end-to-end latency within ``e2e_p99`` (when set); targets in seconds, None for no target
(loadtest/summary.py judges a request by it). Standard library only: the policies and the load generator share it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotune.units import format_duration

NAMES = {"tbt_p99": "p99 TBT", "ttft_p99": "p99 TTFT", "e2e_p99": "p99 E2E"}  # as a reader sees each target


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds; None = no target."""

    tbt_p99: float | None = None
    ttft_p99: float | None = None
    e2e_p99: float | None = None

    def __post_init__(self) -> None:
        for name in NAMES:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}: a target must be > 0 seconds, got {value!r}")

    def as_dict(self) -> dict[str, float | None]:
        return {"tbt_p99": self.tbt_p99, "ttft_p99": self.ttft_p99, "e2e_p99": self.e2e_p99}

    @classmethod
    def from_dict(cls, d: dict[str, float | None] | None) -> SLO:
        """From ``as_dict()``'s form (keys not named are no target)."""
        d = d or {}
        return cls(*(None if d.get(k) is None else float(d[k]) for k in NAMES))  # type: ignore[arg-type]

    def words(self) -> str:
        """``p99 TBT <= 50ms and p99 TTFT <= 2s``."""
        return " and ".join(f"{NAMES[k]} <= {format_duration(v)}" for k, v in self.as_dict().items() if v is not None)
