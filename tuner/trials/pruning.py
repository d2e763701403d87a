"""Early stop of a trial whose p99 TBT is already lost, judged from the engine's inter-token-latency histogram.

p99 TBT <= target means at most 1 % of the window's gaps exceed the target. The watcher takes the histogram at
the start of the window and again every progress tick; the gaps above the smallest bucket bound >= target are
surely above the target (an undercount, so the judgement is conservative). Once enough gaps were seen and their
violating share is several times 1 %, the SLO is clearly lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies import PruningSpec


def gaps_above(before: dict[float, float], after: dict[float, float], target: float) -> tuple[float, float]:
    """(gaps in the interval, gaps surely above ``target``) between two histogram snapshots."""
    total = after.get(math.inf, 0.0) - before.get(math.inf, 0.0)
    bound = min((b for b in after if b >= target), default=math.inf)
    below = after.get(bound, 0.0) - before.get(bound, 0.0)
    return total, max(0.0, total - below)


@dataclass
class PruneWatcher:
    target: float
    spec: PruningSpec
    window_s: float
    baseline: dict[float, float] | None = None
    reason: str | None = None

    def check(self, elapsed_in_window: float, now: dict[float, float]) -> str | None:
        """Call with each new snapshot; returns (and keeps) the reason once the trial should stop."""
        if self.reason is not None or not self.spec.enabled:
            return self.reason
        if self.baseline is None:
            self.baseline = now
            return None
        total, above = gaps_above(self.baseline, now, self.target)
        if total < self.spec.min_gaps or elapsed_in_window < self.spec.min_elapsed * self.window_s:
            return None
        share = above / total
        if share > self.spec.violation_share:
            self.reason = (f"pruned {elapsed_in_window:.0f}s into the window: {100 * share:.1f}% of {int(total)} "
                           f"gaps exceed the {self.target * 1000:g}ms TBT target (p99 allows 1%)")
        return self.reason
