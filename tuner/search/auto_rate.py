"""``--rate auto`` (the goodput objective): an offered load at which the default config cannot fully serve within
the SLO, found by doubling the rate and confirming a failure."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tuner.trials.trial_runner import TrialOutcome, TrialRunner


@dataclass
class RateChoice:
    rate: float
    reason: str
    probes: list[dict[str, Any]]


def choose_rate(runner: TrialRunner, out_dir: Path, start: float = 1.0, max_probes: int = 6,
                on_probe: Callable[[float, TrialOutcome], None] | None = None) -> RateChoice:
    """An offered load at which the default config (the runner's base knobs) cannot fully serve within the SLO:
    probe ``start`` req/s and double until the default's attainment drops below 90 %, confirmed by a second probe
    at the same rate. A failure the repeat does not confirm marks a rate at the edge of the default's capacity,
    where the machine's noise decides (there the default trial may well pass, and the study could not tell the
    configs apart): the doubling goes on. When the probes run out, the last failing rate (else the highest)."""
    probes: list[dict[str, Any]] = []
    rate, failures_here = start, 0
    for i in range(max_probes):
        o = runner.run({}, out_dir / f"rate-probe-{i}", rate=rate)
        att = o.summary.get("attainment") if o.summary else None
        probes.append({"rate": rate, "attainment": att, "tbt_p99": o.summary.get("tbt_p99") if o.summary else None,
                       "goodput_rps": o.summary.get("goodput_rps") if o.summary else None, "reason": o.reason})
        if on_probe is not None:
            on_probe(rate, o)
        if att is None or att < 0.9:
            failures_here += 1
            if failures_here == 2 or i == max_probes - 1:
                how = "no request attained" if att is None else f"attainment {att:.0%} < 90%"
                confirmed = "twice" if failures_here == 2 else "once (no probe left to confirm it)"
                return RateChoice(rate, f"default config at {rate:.3g} req/s: {how} ({o.reason or 'within the SLO'}),"
                                        f" {confirmed}; probes: {_probe_text(probes)}", probes)
            continue  # the same rate again
        failures_here = 0
        rate *= 2
    rate /= 2
    return RateChoice(rate, f"the default config attained >= 90% up to {rate:.3g} req/s in {max_probes} probes; "
                            f"using the highest probed rate ({_probe_text(probes)})", probes)


def _probe_text(probes: list[dict[str, Any]]) -> str:
    return ", ".join(f"{p['rate']:.3g} req/s -> " + ("-" if p["attainment"] is None else f"{p['attainment']:.0%}")
                     for p in probes)
