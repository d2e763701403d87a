"""Each target of an SLO on its own, over the requests of a measurement: the share of requests within it, and the
value of it that the target share of the requests reached (tuner/measure/measurement.py keeps one per measurement;
the floor, tuner/measure/floor.py, one for the requests served one at a time). It says which target binds and the
nearest targets the requests would meet."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from slotune.slo import SLO
from slotune.units import format_duration
from tuner.measure.dependence import attainment_interval, block_counts, clustered_quantile_interval
from tuner.measure.statistics import Interval, lower_verdict


@dataclass(frozen=True)
class Reached:
    """Each target of the SLO on its own, over the requests of a measurement: the share within it, and the value
    of it that the target share of the requests reached (the target share's quantile of the requests' own TTFTs, of
    their own p99 gaps; their intervals on the measurement's blocks). A target that keeps the share below the
    target share on its own binds; the quantile is the nearest target of its kind that these requests would meet."""

    within_ttft: Interval  # n = 0 without a TTFT target
    within_tbt: Interval
    ttft: Interval
    tbt: Interval
    target_share: float
    ttft_target: float | None  # the targets the shares are within
    tbt_target: float | None

    def binds(self) -> list[str]:
        """The targets shown to keep the share below the target share on their own ("ttft", "tbt")."""
        return [name for name, share in (("ttft", self.within_ttft), ("tbt", self.within_tbt))
                if share.n and lower_verdict(share, self.target_share) == "missed"]

    def binds_text(self) -> str:
        """``TTFT <= 2s binds (3% (0-21) within it)`` (empty when no target binds on its own)."""
        bound = {"ttft": f"TTFT <= {format_duration(self.ttft_target)}",
                 "tbt": f"p99 TBT <= {format_duration(self.tbt_target)}"}
        within = {"ttft": self.within_ttft, "tbt": self.within_tbt}
        return " and ".join(f"{bound[b]} binds ({within[b].format('%', 100, 3)} within it)" for b in self.binds())

    def describe(self) -> str:
        """``TTFT <= 2s binds (3% (0-21) within it); 90% of the requests reached TTFT 8.1s (7.7-9.6), p99 TBT ...``"""
        binds = self.binds_text()
        reached = (f"{self.target_share:.0%} of the requests reached TTFT {self.ttft.format('s', 1, 3)}, p99 TBT "
                   f"{self.tbt.format('ms', 1000, 3)}")
        return f"{binds}; {reached}" if binds else reached

    def as_dict(self) -> dict[str, Any]:
        return {"within_ttft": self.within_ttft.as_dict(), "within_tbt": self.within_tbt.as_dict(),
                "ttft": self.ttft.as_dict(), "tbt": self.tbt.as_dict(), "target_share": self.target_share,
                "ttft_target": self.ttft_target, "tbt_target": self.tbt_target, "binds": self.binds()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Reached:
        read = Interval.from_dict
        return cls(read(d["within_ttft"]), read(d["within_tbt"]), read(d["ttft"]), read(d["tbt"]),
                   float(d["target_share"]), d.get("ttft_target"), d.get("tbt_target"))


def reached(ttfts: list[list[float]], tbts: list[list[float]], slo: SLO, level: float, share: float,
            block: int) -> Reached:
    """:class:`Reached` of the requests of each window in send order, with their own TTFTs and p99 gaps (inf: never
    answered), at ``level`` against the target ``share``; each window cut into blocks of ``block`` (none spans two
    windows)."""

    def within(values: list[list[float]], target: float | None) -> Interval:
        if target is None:
            return attainment_interval([], level, share)
        return attainment_interval([b for w in values for b in block_counts([v <= target for v in w], block)],
                                   level, share)

    clusters: list[int] = []
    for w in ttfts:  # each block one cluster, as the blocks cut them
        first = clusters[-1] + 1 if clusters else 0
        clusters += [first + min(i // max(1, block), max(0, len(w) // max(1, block) - 1)) for i in range(len(w))]
    flat_ttft = np.array([v for w in ttfts for v in w], dtype=float)
    flat_tbt = np.array([v for w in tbts for v in w], dtype=float)
    with np.errstate(invalid="ignore"):  # a quantile between two infinite values is infinite, not NaN
        ttft = clustered_quantile_interval(flat_ttft, np.array(clusters, dtype=int), share, level)
        tbt = clustered_quantile_interval(flat_tbt, np.array(clusters, dtype=int), share, level)
    return Reached(within(ttfts, slo.ttft_p99), within(tbts, slo.tbt_p99), _inf_if_nan(ttft), _inf_if_nan(tbt), share,
                   slo.ttft_p99, slo.tbt_p99)


def _inf_if_nan(i: Interval) -> Interval:
    return replace(i, value=math.inf) if i.n and math.isnan(i.value) else i
