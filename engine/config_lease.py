"""Config leases: a live config that the engine returns from by itself unless it is confirmed in time, so a
controller that dies mid-canary leaves nothing unconfirmed behind."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.errors import LeaseConflict


@dataclass(frozen=True)
class ConfigLease:
    """An applied config that the engine reverts by itself unless it is confirmed before `deadline`."""

    generation: int  # the leased generation
    kept_generation: int  # the last kept (confirmed or unleased) generation, whose knobs come back on expiry
    revert_to: dict[str, Any]
    lease_s: float
    deadline: float  # time.monotonic()

    def as_dict(self) -> dict[str, Any]:
        return {"generation": self.generation, "kept_generation": self.kept_generation, "lease_s": self.lease_s,
                "expires_in_s": max(0.0, self.deadline - time.monotonic())}


class LeaseBook:
    """The lease in force (at most one) and how many leases expired; owned by the engine thread."""

    def __init__(self) -> None:
        self.current: ConfigLease | None = None
        self.reverts = 0

    def applied(self, before: EngineConfig, new: EngineConfig, lease_s: float | None) -> None:
        """Record that `new` replaced `before`, under a lease of `lease_s` seconds or kept as it is (None)."""
        if lease_s is None:
            self.current = None
            return
        # Under a lease already: expiry still returns to the last kept config, not to the leased one before.
        kept = self.current
        self.current = ConfigLease(new.generation, kept.kept_generation if kept else before.generation,
                                   kept.revert_to if kept else before.knobs(), lease_s,
                                   time.monotonic() + lease_s)

    def confirm(self, generation: int, applied_generation: int) -> None:
        """Keep the leased config of `generation`; LeaseConflict when that generation is not under lease."""
        lease = self.current
        if lease is None or lease.generation != generation:
            held = f"generation {lease.generation} is" if lease else "no generation is"
            raise LeaseConflict(f"generation {generation} is not under lease ({held}; the applied generation is "
                                f"{applied_generation})", "generation")
        self.current = None

    def take_expired(self) -> ConfigLease | None:
        """The lease whose deadline passed (it is then off the book and counted as a revert), else None."""
        lease = self.current
        if lease is None or time.monotonic() < lease.deadline:
            return None
        self.current = None
        self.reverts += 1
        return lease

    def wait_s(self, idle_wait_s: float) -> float:
        """How long an idle engine thread may sleep before the lease in force needs it."""
        if self.current is None:
            return idle_wait_s
        return min(idle_wait_s, max(0.0, self.current.deadline - time.monotonic()))
