"""The attainment trigger judged over time: one CUSUM of the requests that missed the SLO, on consecutive,
non-overlapping looks (each ``triggers.window`` long), with a stated rate of false alarms per hour on traffic that
attains exactly ``triggers.attainment_target``.

- **A look** holds the requests that finished in it; at a rate too low for one window to hold
  ``triggers.min_requests``, windows merge until it does (a share of a few requests is far from normal in its tail).
- **The scale**: each look's miss share on the arcsine square-root scale (Anscombe's form), where a binomial share's
  variance is 1 / (4 n + 2) at any share and a clustered one's tail is far less skewed than the share's.
- **Clustered misses**: requests that queue behind one burst miss together, so a look's figure spreads more than a
  binomial one. The binomial variance is multiplied by a design effect, the larger of two estimates, each at its
  upper confidence bound (``DISPERSION_CONFIDENCE``) and at least 1: the spread of ``BATCHES`` batches of
  consecutive scrapes around their look's own figure, and the long-run variance (lag-one autocovariance included)
  of the last ``DISPERSION_LOOKS`` looks. A look joins the latter once the CUSUM is back at zero, so that a
  shortfall that begins does not widen the noise it is judged against before it can alarm.
- **The CUSUM** sums each look's standardised excess of misses over the target's miss share ``1 - target``, less
  its reference value k, half the shortfall it is tuned to (``canary.min_effect``: a smaller shortfall is one no
  canary would show a candidate fixes) in that look's standard errors. Its threshold h gives, by Siegmund's
  approximation, an average run of looks without an alarm that spends ``triggers.attainment_alarms_per_hour``.
- **A shortfall that persists**: one look adds at most h / PERSIST, so an alarm needs PERSIST looks beyond the
  noise.

Traffic that attains more than the target drifts the sum down: the stated rate is the most false alarms there are.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from scipy import stats

from policies.control import Triggers
from tuner.control.drift import cusum_threshold

BATCHES = 4  # batches of consecutive scrapes per look, for the dispersion of its misses
DISPERSION_LOOKS = 30  # looks the dispersion is pooled over
PERSIST = 3  # one look adds at most h / PERSIST to the sum: a shortfall must last this many looks
MIN_LOOKS = 3  # looks before the between-look spread is estimated at all
DISPERSION_CONFIDENCE = 0.75  # the dispersion is its upper bound at this confidence (chi-square, pooled batches)


@dataclass(frozen=True)
class Counts:
    """The requests of a span between two scrapes: those that finished, and the misses of each target as its own
    histogram counts them, unclipped.

    The targets' misses are counted on different requests at the edges of a span (the TBT and E2E histograms count
    a request when it finishes, the TTFT one at its first token), so a short span's counts do not line up. Summed
    over consecutive spans they telescope to the whole span's: a look is judged on its sums, never on per-span
    figures clipped and added (which lose every request whose first token and finish fall in different spans)."""

    seconds: float
    finished: int
    missed_tbt: float  # finished requests whose own p99 gap missed its target (aborted ones included)
    missed_ttft: float = 0.0  # requests whose first token came in the span and missed the TTFT target
    missed_e2e: float = 0.0  # requests finished on stop or length in the span that missed the E2E target

    @classmethod
    def of(cls, seconds: float, finished: int, attaining: int) -> Counts:
        """A span whose misses are known per request (one figure for both targets)."""
        return cls(seconds, finished, finished - attaining)

    @property
    def missed(self) -> int:
        """At least the largest of the targets' misses (each is a lower bound of the joint count), within what
        finished."""
        return min(self.finished, max(0, round(max(self.missed_tbt, self.missed_ttft, self.missed_e2e))))

    @property
    def attaining(self) -> int:
        return self.finished - self.missed


def merged(spans: list[Counts]) -> Counts:
    """Consecutive spans as one: their counts summed before the misses are judged."""
    return Counts(sum(c.seconds for c in spans), sum(c.finished for c in spans),
                  sum(c.missed_tbt for c in spans), sum(c.missed_ttft for c in spans),
                  sum(c.missed_e2e for c in spans))


def batches(intervals: list[Counts], count: int = BATCHES) -> list[tuple[int, int]]:
    """(finished, missed) of ``count`` runs of consecutive intervals, each about an equal share of the time."""
    total = sum(c.seconds for c in intervals) or 1.0
    runs: list[list[Counts]] = [[] for _ in range(count)]
    elapsed = 0.0
    for c in intervals:
        runs[min(count - 1, int(count * (elapsed + c.seconds / 2) / total))].append(c)
        elapsed += c.seconds
    parts = [merged(run) for run in runs]
    return [(c.finished, c.missed) for c in parts if c.finished > 0]


def scaled(missed: float, finished: float) -> float:
    """The miss share on the arcsine square-root scale, Anscombe's form: a binomial share's variance there is
    1 / (4 finished + 2) at any share, a few misses included, and a clustered one's tail is much less skewed than
    the share's."""
    return math.asin(math.sqrt(min(1.0, max(0.0, (missed + 0.375) / (finished + 0.75)))))


def precision(finished: float) -> float:
    """1 / the variance of a binomial share of ``finished`` requests on the scale of :func:`scaled`."""
    return 4 * finished + 2


def upper(estimate: float, df: float) -> float:
    """A variance ratio's upper bound at DISPERSION_CONFIDENCE from its estimate on ``df`` degrees of freedom."""
    return estimate * df / float(stats.chi2.ppf(1 - DISPERSION_CONFIDENCE, df))


@dataclass
class AttainmentMonitor:
    spec: Triggers
    shortfall: float  # the drop of attainment below the target that the CUSUM is tuned to find
    cusum: float = 0.0
    looks: int = 0
    partial: list[Counts] = field(default_factory=list)  # a look that does not hold min_requests yet
    # per judged look: its batches' squared deviations from the look's figure in standard units, batches - 1
    spread: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=DISPERSION_LOOKS))
    history: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=DISPERSION_LOOKS))  # (finished, figure)
    pending: list[tuple[int, float]] = field(default_factory=list)  # judged since the sum last stood at zero

    def reset(self) -> None:
        """After a decision: the config changed, the sum starts again (the dispersion is the traffic's and stays)."""
        self.cusum, self.looks, self.partial, self.pending = 0.0, 0, [], []

    def dispersion(self) -> float:
        """The design effect of a look's figure: at least 1, the larger of the within-look (batches) and
        between-look estimates, each at its upper confidence bound."""
        estimates = [1.0]
        df = sum(d for _, d in self.spread)
        if df:
            estimates.append(upper(sum(s for s, _ in self.spread) / df, df))
        looks = list(self.history)
        if len(looks) >= MIN_LOOKS:
            # the long-run variance of the looks' standardised figures (lag-one autocovariance included: one burst
            # may straddle two looks, and the CUSUM sums them)
            finished = sum(n for n, _ in looks)
            mean = sum(n * y for n, y in looks) / finished
            residuals = [(y - mean) * math.sqrt(precision(n)) for n, y in looks]
            gamma0 = sum(r * r for r in residuals) / len(residuals)
            gamma1 = sum(a * b for a, b in itertools.pairwise(residuals)) / len(residuals)
            estimates.append(upper(gamma0 + 2 * max(gamma1, 0.0), len(looks) - 1))
        return max(estimates)

    def threshold(self, k: float, look_s: float) -> float:
        looks_per_hour = 3600.0 / max(look_s, 1e-9)
        return cusum_threshold(round(min(max(k, 0.01), 20.0), 2), looks_per_hour / self.spec.attainment_alarms_per_hour)

    def add(self, intervals: list[Counts]) -> dict[str, Any] | None:
        """Feed one window's scrape intervals (``triggers.window`` long); the alarm's evidence when the CUSUM
        crossed its threshold."""
        look = self.partial + intervals
        whole = merged(look)
        finished, missed = whole.finished, whole.missed
        if finished < self.spec.min_requests:
            self.partial = look
            return None
        self.partial = []
        self.looks += 1
        figure = scaled(missed, finished)
        phi = self.dispersion()
        parts = batches(look)
        self.spread.append((sum(precision(n) * (scaled(m, n) - figure) ** 2 for n, m in parts), len(parts) - 1))
        null = math.asin(math.sqrt(1.0 - self.spec.attainment_target))
        shifted = math.asin(math.sqrt(min(1.0, 1.0 - self.spec.attainment_target + self.shortfall)))
        unit = math.sqrt(precision(finished) / phi)  # standard errors per unit of the scale
        z, k = (figure - null) * unit, 0.5 * (shifted - null) * unit
        seconds = whole.seconds
        h = self.threshold(k, seconds)
        # no one look carries the sum past h: it adds at most h / PERSIST, so a shortfall must last PERSIST looks
        self.cusum = max(0.0, self.cusum + min(z - k, h / PERSIST))
        # a look joins the between-look noise once the sum is back at zero: a shortfall that begins does not widen
        # the noise it is judged against before it can alarm (on an alarm its looks are dropped)
        self.pending.append((finished, figure))
        if self.cusum == 0.0:
            self.history.extend(self.pending)
            self.pending = []
        if self.cusum < h * (1 - 1e-9):
            return None
        return {"cusum": round(self.cusum, 3), "threshold": round(h, 3), "k": round(k, 3),
                "dispersion": round(phi, 3), "look": {"seconds": round(seconds, 1), "finished": finished,
                                                      "attaining": finished - missed},
                "looks": self.looks, "target": self.spec.attainment_target, "shortfall": self.shortfall,
                "alarms_per_hour": self.spec.attainment_alarms_per_hour}
