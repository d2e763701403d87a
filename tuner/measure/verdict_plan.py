"""How the verdict's measurements are sized, from the policy (tuner/measure/verdict.py says what they decide).

Every verdict measurement is one sustained window: a rate shown served is one the engine sustains that long. A
candidate's window holds enough blocks to show it served at its pool level if every block attains (and a quarter
more, as a few will not). The default's beside it, on the same arrivals, is half as long: a miss shows within a few
blocks, and its blocks pair with the candidate's first half for the paired difference. The default's at its own
ceiling is the policy's ``verdict.window``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pathlib import Path

from policies import Policy
from tuner.measure.capacity import measurement_spec
from tuner.measure.measurement import Measurement, MeasurementSpec, measure
from tuner.measure.verdict import RATES_PER_CANDIDATE, Contender, Sample, pool_levels, rate_key
from tuner.measure.verdict_rounds import ceiling_rate
from tuner.trials.trial_backend import TrialBackend

SHOW_MARGIN = 1.25  # a candidate's window: this many times the blocks that show the share when every block attains


@dataclass(frozen=True)
class VerdictPlan:
    spec: MeasurementSpec  # the policy's measurement, at its level
    candidates: int
    window: float  # the default's sustained window (verdict.window)
    warmup: float
    step: float  # a candidate is first measured one step below its searched capacity, then a step lower
    switch_s: float = 0.0  # what changing config costs before a measurement (an engine restarted per config)

    @classmethod
    def of(cls, policy: Policy) -> VerdictPlan:
        return cls(measurement_spec(policy), policy.verdict.candidates, policy.verdict.window, policy.warmup,
                   1 + policy.capacity.resolution)

    def spec_for(self, default: bool, beside: bool = True, rate: float = 0.0) -> MeasurementSpec:
        """The measurement of one side (the default beside a candidate, or at its own ceiling) at ``rate``: at its
        pool level, in one sustained window of its length."""
        level = pool_levels(self.spec.level, self.candidates)[1 if default else 0]
        return replace(self.spec, level=level, sustained_s=self.window_for(default, beside, rate))

    def window_for(self, default: bool, beside: bool = True, rate: float = 0.0) -> float:
        """The sustained window of one side at ``rate`` (0: a rate of 1 req/s or more): it holds the blocks, not the
        seconds, a candidate needs, so a low rate gets a longer window (a block is at least MIN_BLOCK requests)."""
        spec = replace(self.spec, level=pool_levels(self.spec.level, self.candidates)[0])
        candidate = max(self.window, spec.seconds_to_show(rate, SHOW_MARGIN))
        if not default:
            return candidate
        return max(self.window, candidate / 2) if beside else self.window

    def round_s(self, plan: list[tuple[bool, bool, float]]) -> float:
        """A round of measurements (default?, beside a candidate?, rate), a warm-up (and a config change) before
        each, no idle waits."""
        return sum(self.window_for(default, beside, rate) + self.warmup + self.switch_s
                   for default, beside, rate in plan)

    def full_round_s(self, rate: float = 0.0) -> float:
        """A first round: each candidate, the default beside each, and the default at its own ceiling, all near
        ``rate`` (0: 1 req/s or more; below, a window holding the same blocks is longer)."""
        return self.round_s([(False, True, rate)] * self.candidates + [(True, True, rate)] * self.candidates
                            + [(True, False, rate)])

    @property
    def rates_per_candidate(self) -> int:
        return RATES_PER_CANDIDATE

    def beside(self, c: Contender, rate: float) -> bool:
        """Whether ``c`` at ``rate`` is measured beside a candidate (every measurement but the default's at its own
        ceiling)."""
        return not c.is_default or ceiling_rate(c, self.step) != rate_key(rate)

    def spec_at(self, c: Contender, rate: float) -> MeasurementSpec:
        return self.spec_for(c.is_default, self.beside(c, rate), rate)

    def measure(self, backend: TrialBackend, c: Contender, rate: float, draw: int, out_dir: Path) -> Measurement:
        """One sustained verdict measurement of ``c`` at ``rate`` on arrival draw ``draw``, in
        ``out_dir``/draw-D/NAME/rate-R."""
        folder = Path(out_dir) / f"draw-{draw}" / c.name.split(" (")[0].replace(" ", "-") / f"rate-{rate:.4g}"
        return measure(backend, c.knobs, rate, folder, draw, self.spec_at(c, rate))

    def round_cost(self, plan: list[tuple[Contender, float]]) -> float:
        """What a round of these measurements takes (paired_verdict's ``cost``)."""
        return self.round_s([(c.is_default, self.beside(c, r), r) for c, r in plan])


def sample_of(m: Measurement, draw: int) -> Sample:
    """A verdict measurement as its pool keeps it."""
    f = m.figures
    return Sample(m.rate, draw, f.blocks if f is not None else (), m.reason, m.void, m.output_tokens_per_s,
                  m.describe())
