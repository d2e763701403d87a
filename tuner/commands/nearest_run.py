"""``tune``'s answer where nothing is served at the SLO asked for: which target binds, and what the machine serves at
the nearest targets it meets (tuner/measure/nearest.py), searched in what is left of the run's time budget.

Two routes lead here: the machine's floor (one request at a time) is above a target, or every config the engine
searched read missed (or undecided) at every rate probed. Either way the run exits 1 and writes no tuned config; the
nearest targets and the capacity there are said on stderr and kept in ``<trials>/nearest.json``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import optuna

from engine.knobs import short_knobs
from slotune.slo import SLO
from slotune.units import format_duration
from tuner.commands.progress import PROG, probe_line, say
from tuner.commands.run_context import RunContext
from tuner.measure.capacity import capacity_searcher
from tuner.measure.nearest import NearestCapacity, nearest_slo, relaxation, search_nearest
from tuner.measure.targets import Reached
from tuner.output import write_report
from tuner.search.study import ROLE_DEFAULT, longest_trial_s, measured
from tuner.search.trial_record import TrialRecord
from tuner.trials.trial_backend import TrialBackend

NEAREST_FILE = "nearest.json"
MIN_SEARCH_S = 120.0  # the least time left in the budget that a search at the nearest targets is started with


def nearest_capacity(context: RunContext, runner: TrialBackend, knobs: dict[str, Any], who: str, reached: Reached,
                     nearer: SLO, source: str, start: float | None, longest_s: float = MIN_SEARCH_S) -> list[str]:
    """``knobs``' capacity at ``nearer``, the nearest targets ``reached`` shows, searched while the run's budget holds
    a search as long as ``longest_s``; the lines that say it, kept in nearest.json."""
    head = (f"the nearest targets this machine meets ({reached.target_share:.0%} of the requests reached them "
            f"{source}): {nearer.words()}")
    left = context.started + context.policy.time_budget - time.monotonic()
    if left < max(MIN_SEARCH_S, longest_s):
        return [f"  {head}; no time left in the budget ({format_duration(max(0.0, left))}) to search the capacity "
                "there"]
    say(f"{PROG}: {head}: searching the {who}'s capacity there ...")
    searcher = capacity_searcher(runner, context.policy)  # its own: what it learns holds at the nearer targets only
    searcher.deadline = context.started + context.policy.time_budget
    searcher.on_probe = probe_line
    found = search_nearest(searcher, context.policy.slo, nearer, source, knobs, context.trials_dir / "nearest", start)
    keep(context.trials_dir, found, who)
    return [f"  {head}; there the {who} serves: {found.capacity.describe()}"]


def keep(trials_dir: Path, found: NearestCapacity, who: str) -> None:
    trials_dir.mkdir(parents=True, exist_ok=True)
    (trials_dir / NEAREST_FILE).write_text(json.dumps({"config": who, **found.as_dict()}, indent=1) + "\n")


def floor_stop(context: RunContext, runner: TrialBackend, why: str, alone: Reached | None, rate: float | None) -> int:
    """The floor is above a target: say so, then the default config's capacity at the nearest targets the floor's
    requests reached one at a time; exit 1."""
    print(f"{PROG}: error: {why}; no config can meet it here (nothing written; floor: "
          f"{context.trials_dir / 'floor' / 'floor.json'})", file=sys.stderr)
    if alone is None or (nearer := nearest_slo(context.policy.slo, alone)) is None:
        return 1
    lines = nearest_capacity(context, runner, {}, "default config", alone, nearer, "one request at a time", rate)
    print("\n".join(lines), file=sys.stderr)
    return 1


def none_shown(context: RunContext, runner: TrialBackend, study: optuna.Study) -> int:
    """No candidate read served at any rate it was searched at: what each search saw, worded by its verdicts (an
    undecided rate is at the edge of the target share, not missed), then the capacity at the nearest targets of the
    config whose lowest rate came nearest; on stderr and in the report; exit 1."""
    p = context.policy
    report = context.out.with_suffix(".html")
    names = [k.name for k in p.search_space]
    slo = p.slo
    lines, undecided = [], False
    nearest: tuple[float, dict[str, Any], str, Reached, SLO, float] | None = None
    for t in measured(study):
        record = TrialRecord.from_trial(t)
        cap = record.capacity
        if cap is None:
            continue
        probes = sorted(cap.get("probes") or [], key=lambda m: -m["rate"])
        undecided |= any(m["verdict"] == "undecided" for m in probes)
        who = "default config" if record.role == ROLE_DEFAULT else short_knobs(record.knobs or {}, names)
        lines.append(f"  #{t.number} {who}: " + ", ".join(f"{m['verdict']} at {m['rate']:.3g} req/s"
                                                           for m in probes) + f" ({cap.get('stopped')})")
        lowest = probes[-1] if probes else None  # sorted from the highest rate down
        if lowest is not None and lowest.get("reached"):
            reached = Reached.from_dict(lowest["reached"])
            lines.append(f"    at {lowest['rate']:.3g} req/s: " + reached.describe())
            nearer = nearest_slo(slo, reached)
            far = relaxation(slo, nearer) if nearer is not None else math.inf
            if nearer is not None and (nearest is None or far < nearest[0]):
                nearest = (far, dict(record.knobs or {}), who, reached, nearer, float(lowest["rate"]))
    advice = ("undecided is not missed: at the edge of the target share only more requests decide (a longer "
              "measurement cap in the policy), and a looser target serves more" if undecided else
              "every rate probed was missed: the targets each config reached at its lowest rate above are the "
              "nearest ones it would meet there")
    if nearest is not None and math.isfinite(nearest[0]):
        _, knobs, who, reached, nearer, rate = nearest
        lines += nearest_capacity(context, runner, knobs, who, reached, nearer, f"at {rate:.3g} req/s", rate,
                                  longest_trial_s(study))
    head = f"{PROG}: no candidate config read served at any rate searched within {context.slo_text()}"
    write_report(report, study, p.slo.as_dict(), f"tune: {context.study_name}", [head] + lines + [advice])
    print("\n".join([head + f" ({len(measured(study))} configs searched):"] + lines + [f"  {advice}; report: {report}"]),
          file=sys.stderr)
    return 1
