"""The simulator against the engine, config by config.

For each config the engine searched (the default's included), the simulator's capacity found the way the engine's was: a twin of
the engine's search run on the simulator (the same measurement sizing, the same first rate and step, each probe on
the same arrival draw; the step-time model rescaled to all the engine's steps). While the two agree at each probe
they walk the same rates, so where they part is where the step-time model and the engine part. Beside it, the
screen's prediction that ranked the config (its median over the screen's own draws, in measurements up to the
screen's longer cap) and, for a verdict candidate, the bracket its sustained measurements showed.

Both searches end in a bracket one resolution step wide, so capacities a step apart may be one: the twin
``agrees`` with the engine when their brackets meet. A search stops measuring a rate as soon as its figures
decide, so a few requests' difference in one window can send the twin along other rates; the rows therefore also
set every window the engine measured beside the simulator's run of that same window (same rate, arrival seed and
length): the step-time model against the engine on identical arrivals, window by window.
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import optuna
from scipy import stats

from policies import Policy
from loadtest.records import RequestRecord
from tuner.measure.capacity import Capacity, Shown, capacity_searcher, measurement_spec
from tuner.measure.measurement import TARGET_SHARE, figures, segment_seed, window_records
from tuner.measure.statistics import DEFAULT_LEVEL
from tuner.search.study import measured
from tuner.search.trial_record import TrialRecord
from tuner.trials.trial_backend import TrialBackend
from slotune import result_files as files

Bracket = list[float | None]  # [low, high]; high None where no rate probed was missed


def twin_search(sim: TrialBackend, policy: Policy, knobs: dict[str, Any], searched: dict[str, Any],
                out_dir: Path) -> Capacity:
    """The engine's capacity search ``searched`` (a trial's ``capacity`` attrs) repeated on the simulator ``sim``."""
    return capacity_searcher(sim, policy).search(knobs, out_dir, draw=int(searched.get("draw", 0)),
                                                 start=float(searched.get("start") or 0) or None,
                                                 step=searched.get("step"))


def same_windows(sim: TrialBackend, policy: Policy, knobs: dict[str, Any], searched: dict[str, Any],
                 trial_dir: Path, out_dir: Path) -> tuple[list[dict[str, Any]], Bracket]:
    """Each window of the engine's search (``trial_dir``/probe-i/segment-j, on arrival seed segment_seed(draw + i,
    j)) run again on the simulator: rate, requests, and both sides' attainment and p99 TTFT; and the bracket the
    simulator's verdicts give on those same windows, pooled per probe as the search pooled them."""
    pairs, verdicts = [], []
    spec, draw = measurement_spec(policy), int(searched.get("draw", 0))
    for i, probe in enumerate(searched.get("probes") or []):
        segments = sorted((trial_dir / f"probe-{i}").glob("segment-*"), key=lambda d: int(d.name.split("-")[1]))
        pooled: list[list[RequestRecord]] = []
        for seg in segments:
            try:
                engine = json.loads((seg / files.SUMMARY).read_text())
                length = float(json.loads((seg / files.TRIAL).read_text())["duration"])
            except (OSError, ValueError, KeyError):
                continue  # a window that measured nothing (a failed start): nothing to set beside it
            j = int(seg.name.split("-")[1])
            o = sim.run(knobs, out_dir / f"probe-{i}" / seg.name, rate=float(probe["rate"]),
                        seed=segment_seed(draw + i, j), duration=length)
            pooled.append(window_records(o))
            simulated = o.summary or {}
            pairs.append({"rate": float(probe["rate"]), "window": j, "requests": engine.get("requests"),
                          "attainment": [engine.get("attainment"), simulated.get("attainment")],
                          "ttft_p99": [engine.get("ttft_p99"), simulated.get("ttft_p99")]})
        if pooled:
            f = figures(pooled, sim.slo, spec, float(probe["rate"]))
            verdicts.append((float(probe["rate"]), reading(f.verdicts["attainment"], f.attainment.value)))
    return pairs, bracket_of(verdicts)


def simulator_error(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The simulator's error on what the search acts on, over a run's configs: |twin / engine - 1| of the searched
    capacities (median and largest), how many twin brackets meet the engine's, and the Spearman rank correlation of
    the two capacities (whether the simulator orders the configs as the engine does; None with fewer than three
    configs or a tie throughout). A run searches a handful of configs: these describe the run, they bound nothing."""
    pairs = [(float(r["twin"]), float(r["measured"])) for r in rows
             if r.get("measured") and r.get("twin") is not None]
    errors = [abs(twin / got - 1) for twin, got in pairs]
    rho = None
    if len(pairs) >= 3 and len({t for t, _ in pairs}) > 1 and len({g for _, g in pairs}) > 1:
        rho = float(stats.spearmanr([t for t, _ in pairs], [g for _, g in pairs]).statistic)
    return {"configs": len(pairs), "median_capacity_error": statistics.median(errors) if errors else None,
            "largest_capacity_error": max(errors) if errors else None,
            "brackets_meet": sum(bool(r.get("agrees")) for r in rows), "spearman": rho}


def error_words(summary: dict[str, Any]) -> str:
    """``the simulator against the engine over 4 configs: capacity error median 8% (largest 21%), 3 of 4 brackets
    meet, rank correlation 0.8``."""
    n = summary["configs"]
    if not n:
        return "the simulator against the engine: no config with a searched capacity on both"
    rho = summary["spearman"]
    return (f"the simulator against the engine over {n} configs: capacity error median "
            f"{summary['median_capacity_error']:.0%} (largest {summary['largest_capacity_error']:.0%}), "
            f"{summary['brackets_meet']} of {n} brackets meet, rank correlation "
            + ("-" if rho is None else f"{rho:.2f}"))


def reading(verdict: str, attainment: float) -> str:
    """How a probe steers a search (Capacity.steer): "met" where shown met or read at least the target share."""
    return "met" if verdict == "met" or (verdict != "missed" and attainment >= TARGET_SHARE) else "missed"


def bracket_of(readings: Sequence[tuple[float, str]]) -> Bracket:
    """The searched bracket that a search's readings (rate, "met" or "missed"; :func:`reading`) leave."""
    return Shown.of(list(readings), DEFAULT_LEVEL).as_list()


def window_agreement(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median absolute difference of attainment (simulator minus engine) over the windows, its largest, and in
    how many windows the two lie on the same side of the 90 % target share."""
    both = [(e, s) for e, s in (p["attainment"] for p in pairs) if e is not None and s is not None]
    if not both:
        return {"windows": 0}
    diffs = [s - e for e, s in both]
    return {"windows": len(both), "median_abs_attainment_diff": statistics.median(abs(d) for d in diffs),
            "largest_attainment_diff": max(diffs, key=abs),
            "same_side_of_90": sum((e >= 0.9) == (s >= 0.9) for e, s in both)}


def brackets_meet(a: Bracket, b: Bracket) -> bool:
    """Whether two capacity brackets overlap or touch (an open high end is infinite); a config served nowhere has
    low 0."""
    a_high = math.inf if a[1] is None else a[1]
    b_high = math.inf if b[1] is None else b[1]
    return (a[0] or 0.0) <= b_high and (b[0] or 0.0) <= a_high


def confirmed_rows(study: optuna.Study, sim: TrialBackend, policy: Policy, out_dir: Path,
                   sustained: Callable[[dict[str, Any]], Bracket | None]) -> list[dict[str, Any]]:
    """One row per config the engine searched: the screen's prediction (a screened config's), the twin search's
    capacity and bracket, the engine's, and ``sustained(knobs)``: the verdict's bracket for a candidate it measured,
    else None."""
    rows = []
    for t in measured(study):
        record = TrialRecord.from_trial(t)
        if record.capacity is None:
            continue
        searched = record.capacity
        knobs = dict(record.knobs or {})
        engine: Bracket = list(searched.get("bracket") or [t.values[0], None])
        folder = record.steps_dir
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the screen warned of the profile's range once already
            twin = twin_search(sim, policy, knobs, searched, out_dir / f"trial-{t.number:04d}")
            windows, replayed = same_windows(sim, policy, knobs, searched, Path(folder),
                                             out_dir / f"trial-{t.number:04d}-windows") if folder else ([], [0.0, None])
        twin_bracket = twin.bracket
        predicted, got = record.screen_predicted_capacity, t.values[0]
        rows.append({"trial": t.number, "role": record.role, "knobs": knobs, "measured": got,
                     "bracket": engine,
                     "twin": twin.low, "twin_bracket": twin_bracket,
                     "twin_probes": [[m.rate, m.verdict] for m in twin.probes],
                     "engine_probes": [[m["rate"], m["verdict"]] for m in searched.get("probes") or []],
                     "twin_over_measured": twin.low / got if got else None,
                     "agrees": brackets_meet(twin_bracket, engine),
                     "windows": windows, "window_agreement": window_agreement(windows),
                     "same_windows_bracket": replayed, "same_windows_agree": brackets_meet(replayed, engine),
                     "predicted": predicted, "predicted_over_measured": predicted / got if predicted and got else None,
                     "sustained_bracket": sustained(knobs)})
    return rows
