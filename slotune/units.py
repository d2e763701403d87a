"""Durations as people write them: ``50ms``, ``2s``, ``1.5m``, ``1h``, ``1m30s``, ``250us``; a bare number is seconds.

The project's one duration parser and formatter: the load generator's options, the policies' SLO targets and
windows, and the tuner's flags read durations here. Standard library only, so every layer may import it (the
policies never import the load generator).
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "m": 60.0,
    "min": 60.0,  # "m" is minutes, never meters or months
    "h": 3600.0,
}
_PART = re.compile(r"((?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?)(ns|us|µs|ms|sec|min|s|m|h)?")


def parse_duration(text: str | float | int) -> float:
    """Return the duration in seconds. Accepts numbers (seconds) and strings like ``50ms``, ``2s``, ``1m30s``.

    Raises ValueError on anything else, including negative or non-finite values.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a duration: {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = str(text).strip().lower().replace(" ", "")
        if not s:
            raise ValueError("empty duration")
        pos, value, parts = 0, 0.0, 0
        while pos < len(s):
            m = _PART.match(s, pos)
            if not m or m.end() == pos:
                raise ValueError(f"not a duration: {text!r} (use e.g. 50ms, 2s, 1m30s)")
            number = float(m.group(1))
            unit = m.group(2)
            if unit is None and (parts or m.end() != len(s)):
                raise ValueError(f"not a duration: {text!r} (a number without a unit must stand alone)")
            value += number * _UNITS[unit or "s"]
            pos, parts = m.end(), parts + 1
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"not a duration: {text!r} (must be finite and >= 0)")
    return value


def format_duration(seconds: float | None) -> str:
    """Short human form: ``850us``, ``12.3ms``, ``1.50s``, ``2m05s``; ``-`` for None/NaN."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    s = float(seconds)
    sign = "-" if s < 0 else ""
    s = abs(s)
    if s < 1e-3:
        return f"{sign}{s * 1e6:.0f}us"
    if s < 1.0:
        return f"{sign}{s * 1e3:.3g}ms" if s * 1e3 < 100 else f"{sign}{s * 1e3:.0f}ms"
    if s < 60.0:
        return f"{sign}{s:.2f}s"
    minutes, rest = divmod(s, 60.0)
    if minutes < 60:
        return f"{sign}{int(minutes)}m{rest:04.1f}s"
    hours, minutes = divmod(minutes, 60.0)
    return f"{sign}{int(hours)}h{int(minutes):02d}m"
