"""Judging a canary: its attainment against the window before it (a Newcombe interval of the difference of the two
shares). Keep it when it is better beyond the noise (after ``min_window`` and ``min_requests``); roll back at once
when it is worse by more than ``rollback_drop`` beyond the noise; roll back at the end of ``max_window`` otherwise.

A canary that inherits a queue the config before could not keep up with (that queue grew over the window before)
cannot show better attainment in its window: its own arrivals wait behind the inherited requests, first come first
served. It is judged by what it does to that queue instead: kept when it finishes requests faster than the config
before did (both backlogged, so a finishing rate is the config's service rate; a Poisson rate-ratio interval
above 1) while the queue shrinks, or, at the end of its window, faster beyond the noise even if the queue has not
shrunk yet (rolling back would restore the slower config); and the rollback rule waits for its own arrivals (the inherited requests' waits
are the config before's doing). Such a config before is also judged over the requests that arrived in its window,
not only those that finished: the ones its queue grew by had not attained, and its finished ones alone (often
still the traffic from before a shift) would make any canary look worse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.control import Canary
from tuner.control.window import WindowStats
from tuner.measure.statistics import Interval, proportion_difference_interval, rate_ratio_interval

MIN_FOR_ROLLBACK = 5  # finished canary requests before an early rollback is judged
MIN_QUEUE_GROWTH = 3  # requests: a window before whose queue grew by fewer than this (or 10 % of its finished) kept up


def fell_behind(before: WindowStats) -> bool:
    """The config before did not keep up: its queue grew over its window."""
    return before.arrived - before.finished >= max(MIN_QUEUE_GROWTH, 0.1 * before.finished)


def baseline(before: WindowStats) -> tuple[int, int]:
    """The config before's attaining requests and the number they are a share of: those that finished, or, when it
    fell behind, those that arrived."""
    return before.attaining, before.arrived if fell_behind(before) else before.finished


def serves_faster(before: WindowStats, canary: WindowStats) -> Interval | None:
    """When the canary inherited the queue of a config that fell behind (both backlogged, so a finishing rate is a
    service rate): the ratio of its finishing rate to the config before's (else None)."""
    if not fell_behind(before):
        return None
    return rate_ratio_interval(canary.finished, canary.seconds, before.finished, before.seconds)


def drains(before: WindowStats, canary: WindowStats) -> Interval | None:
    """The same ratio, only once the queue shrank under the canary (else None): a keep before the window's end."""
    return serves_faster(before, canary) if canary.arrived < canary.finished else None


@dataclass(frozen=True)
class CanaryVerdict:
    action: str  # "continue" | "keep" | "rollback"
    reason: str
    difference: Interval  # canary attainment - before attainment

    def as_dict(self) -> dict[str, Any]:
        return {"action": self.action, "reason": self.reason, "difference": self.difference.as_dict()}


def judge(before: WindowStats, canary: WindowStats, elapsed: float, spec: Canary,
          fresh: WindowStats | None | bool = True) -> CanaryVerdict:
    """``canary``: everything that finished since the canary started (the rollback rule judges it). ``fresh``: the
    requests that finished after those queued at the start had finished (FCFS: the canary's own arrivals), which a
    keep is judged on; True: the same as ``canary``; None/False: that queue has not drained yet (no keep)."""
    diff = proportion_difference_interval(canary.attaining, canary.finished, *baseline(before))
    shown = diff.format(scale=100, unit=" pp")
    own = canary if fresh is True else fresh if isinstance(fresh, WindowStats) else None
    # the rollback rule judges the canary's own arrivals once the inherited queue has drained; before that, all
    # that finished, unless the config before fell behind: then the inherited requests' waits are its doing, and
    # they would roll back any canary at once
    judged = own if own is not None else None if fell_behind(before) else canary
    if judged is not None and judged.finished >= MIN_FOR_ROLLBACK:
        drop = proportion_difference_interval(judged.attaining, judged.finished, *baseline(before))
        if drop.high < -spec.rollback_drop:
            return CanaryVerdict("rollback", f"the SLO broke: attainment fell by {drop.format(scale=100, unit=' pp')}"
                                             f", more than canary.rollback_drop ({spec.rollback_drop:.0%}) beyond the "
                                             f"noise" + ("" if judged is canary else " (its own arrivals)"), drop)
    if own is not None and elapsed >= spec.min_window and own.finished >= spec.min_requests:
        own_diff = proportion_difference_interval(own.attaining, own.finished, *baseline(before))
        if own_diff.low > 0:
            return CanaryVerdict("keep", f"better beyond the noise: attainment +{own_diff.format(scale=100, unit=' pp')}"
                                         f" over {own.finished} requests"
                                         + ("" if own is canary else " that arrived under the canary"), own_diff)
    drained = drains(before, canary) if own is None else None
    if drained is not None and elapsed >= spec.min_window and canary.finished >= spec.min_requests \
            and drained.low > 1.0:
        return CanaryVerdict("keep", f"drains the queue the config before left (it fell behind): finishes "
                                     f"{drained.format('x', 1, 3)} the requests/s of the config before, the queue "
                                     f"{canary.finished - canary.arrived} shorter after {canary.finished} requests",
                             diff)
    if elapsed >= spec.max_window:
        faster = serves_faster(before, canary) if own is None else None
        if faster is not None and canary.finished >= spec.min_requests and faster.low > 1.0:
            # rolling back would return to the slower config: keep the faster one, and let a later move catch up
            return CanaryVerdict("keep", f"serves faster than the config before (it fell behind): finishes "
                                         f"{faster.format('x', 1, 3)} its requests/s after {canary.finished} "
                                         f"requests, though the queue did not shrink within canary.max_window "
                                         f"({spec.max_window:g}s)", diff)
        why = "too few requests" if canary.finished < spec.min_requests else "no improvement beyond the noise"
        return CanaryVerdict("rollback", f"{why} within canary.max_window ({spec.max_window:g}s): attainment "
                                         f"difference {shown}, {canary.finished} requests", diff)
    return CanaryVerdict("continue", f"{canary.finished} requests, difference {shown}", diff)
