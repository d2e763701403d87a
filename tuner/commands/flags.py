"""What the tuner's command lines share: the flag error, the argparse type of a duration flag, and the early check
of a policy's workload (``tune`` and ``slotune sweep``)."""

from __future__ import annotations

import argparse
from typing import Any

from policies import Policy
from slotune.units import parse_duration


class CliError(Exception):
    """A bad flag value: printed as `tune: error: MESSAGE`, exit 2."""


def duration_arg(text: str) -> float:
    """argparse type of a positive duration flag: ``50ms``, ``2s``, ``1m``."""
    try:
        v = parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def check_workload(policy: Policy) -> None:
    """Build the load schedule once now, so a bad trace fails before any engine starts."""
    from loadtest.config import LoadConfig  # numpy: heavy, not for --help or a flag error
    from loadtest.schedule import build_schedule  # numpy: heavy, not for --help or a flag error

    w = policy.workload
    extra: dict[str, Any] = {k: v for k, v in (("mix", w.mix), ("mix_weights", w.mix_weights)) if v}
    try:
        build_schedule(LoadConfig(workload=w.name, rate=policy.rate or 1.0, duration=policy.trial_duration,
                                  length_scale=w.length_scale, time_scale=w.time_scale, max_context=w.max_context,
                                  trace_offset=w.trace_offset, **extra))
    except (ValueError, OSError) as error:
        raise CliError(f"argument --workload: {error}") from None
