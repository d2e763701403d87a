"""How good is `tune`'s answer? The engine-measured capacity of a fixed design of configs that spans the space, the
simulator's error on it, and what each knob brings.

    python benchmarks/tune_quality.py design --out docs/benchmarks/tune-quality-mixed.json \\
            [--include docs/benchmarks/tune-repro-50ms-zen4/run-0/tuned.yaml ...]
    python benchmarks/tune_quality.py design --workload azure --trace TRACES/azure2023/AzureLLMInferenceTrace_conv.csv \\
            --out docs/benchmarks/tune-quality-azure.json
        One engine (the default model, the README's 50 ms p99 TBT and the default policy's other targets) measures the
        capacity of every config of the design, one after the other, each searched as `tune` searches a candidate
        (the policy's measurement sizing, resolution and probes; one searcher that starts each search from the nearest
        config searched) and every search on the same arrival draws (DESIGN_DRAW). The design, fixed before the run:
          - the default config, first and again last (the machine's drift over the run);
          - the one-knob baseline: the default with chunk_size ONE_KNOB_CHUNK;
          - the simulator's best TOP configs of a screen of SCREEN_N (Latin hypercube on DESIGN_SEED), its step
            times rescaled to the default's engine steps, as tune screens;
          - FILL configs of a second Latin hypercube (DESIGN_SEED + 1) that no other entry holds;
          - each --include (a tuned.yaml: that run's tuned config);
          - then the knock-outs: the best config measured with one searched knob at a time set back to the default's.
        Then, off the engine: the simulator's twin of every search (same draws, first rate and step) with the step
        times rescaled to the default's steps (what the screen ranks by) and to all the design's steps; the capacity
        error |predicted / measured - 1| (median and 90th percentile) and the Spearman rank correlation, each with a
        bootstrap interval over the configs; each included answer's capacity over the best's; what each knob brings.
    (tune's answers are set against a design's best by benchmarks/quality_answers.py; a design's leading configs and
    the answers are searched several times each by benchmarks/tune_quality_repeats.py.)
    python benchmarks/tune_quality.py --simulated design --out /tmp/q.json
        The same with the simulator standing in for the engine (a check of the script, not evidence).

The seeds are fixed here, before the runs, and none was used while developing; every run made is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import engine  # noqa: F401  (before torch: the engine's OpenMP policy applies to what it starts)
import numpy as np
import yaml
from scipy import stats

from engine.cpu_info import cpu_name
from engine.knobs import KNOBS, short_knobs
from policies import Policy, load_policy
from slotune import result_files as files
from tuner.measure.capacity import capacity_searcher
from tuner.search.confirmation import twin_search
from tuner.search.design import config_key, screen_design
from tuner.search.screening import engine_dtype, load_profile, screen_capacity, sim_runner_like
from tuner.simulation.simulator_trial import SimTrialRunner
from tuner.simulation.step_time_model import StepTimeModel
from tuner.trials.engine_handle import ManagedEngine
from tuner.trials.trial_runner import TrialRunner

AZURE_LENGTH_SCALE = 0.0625  # the Azure trace's lengths x1/16, clipped to 2,048 tokens of context
DESIGN_SEED = 52_817  # the screen's and the fill's Latin hypercubes (drawn at random, fixed before the runs)
DESIGN_DRAW = 1500  # probe i of every search on arrival draw DESIGN_DRAW + i (tune's runs use draws below 1400)
SCREEN_N = 40  # the screen's size, as tune's
TOP = 6  # the simulator's best configs in the design
FILL = 16  # the space-filling remainder
ONE_KNOB_CHUNK = 16
BOOTSTRAP = 4000  # bootstrap resamples of the configs for the intervals
LEVEL = 0.95


def entries(policy: Policy, sim: Any, folder: Path, includes: list[Path]) -> list[tuple[str, dict[str, Any]]]:
    """The design after the default: the one-knob baseline, the simulator's best, the fill, the included answers;
    each config once (the first name it was given stands)."""
    ranked = screen_capacity(policy, sim, SCREEN_N, folder / "screen", seed=DESIGN_SEED)
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    out[config_key({"chunk_size": ONE_KNOB_CHUNK})] = ("one-knob", {"chunk_size": ONE_KNOB_CHUNK})
    for i, c in enumerate(ranked[:TOP]):
        out.setdefault(config_key(c.knobs), (f"sim-top-{i + 1}", c.knobs))
    fill = [knobs for knobs, _ in screen_design(policy, SCREEN_N, DESIGN_SEED + 1) if config_key(knobs) not in out]
    for i, knobs in enumerate(fill[:FILL]):
        out[config_key(knobs)] = (f"fill-{i + 1}", knobs)
    for path in includes:
        knobs = yaml.safe_load(path.read_text())["tuned"]["knobs"]
        name = f"tuned:{path.parent.name}"
        key = config_key(knobs)
        out[key] = (out[key][0] + f" = {name}", knobs) if key in out else (name, knobs)
    return list(out.values())


def engine_steps(folder: Path, block_size: int) -> list[dict[str, Any]]:
    """Every step record the engine wrote under ``folder`` (all probes, all windows)."""
    return [{**json.loads(line), "block_size": block_size} for path in sorted(folder.rglob(files.STEPS))
            for line in path.read_text().splitlines() if line.strip()]


def speed(profile: StepTimeModel | None, steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The engine's speed while it measured one config: its decode and prefill steps' median measured / predicted
    time against the uncalibrated ``profile`` (1.0: the profile's machine; a later config measured 10 % slower on
    the same shapes reads 1.1)."""
    fitted = profile.rescaled(steps) if profile is not None else None
    if fitted is None:
        return None
    r = fitted.meta["rescaled"]
    return {"decode": r["scale"], "prefill": r["prefill_scale"], "steps": r["steps"]}


class Design:
    """One design run: the engine (or a simulator standing in for it), one searcher, the rows so far."""

    def __init__(self, policy: Policy, folder: Path, simulated: bool) -> None:
        self.policy, self.folder = policy, folder
        self.engine = None if simulated else ManagedEngine(log_path=str(folder / "engine.log"))
        self.rows: list[dict[str, Any]] = []

    def open(self) -> Any:
        if self.engine is None:
            from tuner.simulation.profiles import limits_of, profile_path
            model = StepTimeModel.load(profile_path(None))
            p = self.policy
            self.runner: Any = SimTrialRunner(model, limits=limits_of(model), workload=p.workload,
                                              duration=p.trial_duration, warmup=p.warmup, slo=p.slo, seed=p.seed)
            self.profile = None
        else:
            self.engine.start()  # before the runner, which reads the engine's config
            p = self.policy
            self.runner = TrialRunner(self.engine, workload=p.workload, duration=p.trial_duration, warmup=p.warmup,
                                      slo=p.slo, seed=p.seed, busy_cores=p.measurement.busy)
            self.profile = load_profile(dtype=engine_dtype(self.runner))
        self.searcher = capacity_searcher(self.runner, self.policy)
        # the default config's values (the schema's defaults under the engine's own config)
        self.base = {k.name: k.default for k in KNOBS} | dict(self.runner.base_knobs or {})
        return self

    def measure(self, name: str, knobs: dict[str, Any], like: dict[str, Any] | None = None, draw: int = DESIGN_DRAW,
                first: tuple[float, float] | None = None) -> dict[str, Any]:
        """``knobs``' capacity searched on the arrival draws from ``draw`` (the design's unless told), from ``like``'s
        first rate and step (a repeat) or from ``first`` (rate, step); else from the nearest config searched."""
        folder = self.folder / "configs" / f"{len(self.rows):02d}-{name.split(' ')[0].replace(':', '-')}"
        shutil.rmtree(folder, ignore_errors=True)
        t0 = time.monotonic()
        if like is not None:
            first = (like["capacity"]["start"], like["capacity"]["step"])
        cap = self.searcher.search(knobs, folder, draw=draw, start=first[0] if first else None,
                                   step=first[1] if first else None)
        full = {**self.base, **knobs}
        row = {"name": name, "knobs": full, "capacity": cap.as_dict(), "req_per_s": cap.value,
               "bracket": cap.bracket, "seconds": time.monotonic() - t0, "folder": str(folder.relative_to(self.folder)),
               "speed": speed(self.profile, engine_steps(folder, int(full.get("block_size", 16))))}
        self.rows.append(row)
        print(f"[{len(self.rows)}] {name} {short(full)}: {cap.describe()} ({row['seconds']:.0f}s; speed "
              f"{row['speed']})", flush=True)
        return row

    def default_steps(self) -> list[dict[str, Any]]:
        return engine_steps(self.folder / self.rows[0]["folder"], int(self.base.get("block_size", 16)))

    def knockouts(self) -> None:
        """The best config measured, with each searched knob set back to the default's value in turn."""
        best = max(self.rows, key=lambda r: r["req_per_s"])
        seen = {config_key(r["knobs"]) for r in self.rows}
        for k in self.policy.search_space:
            knobs = self.policy.repair({**best["knobs"], k.name: self.base.get(k.name)})
            if config_key({**self.base, **knobs}) not in seen:
                seen.add(config_key({**self.base, **knobs}))
                self.measure(f"knockout-{k.name} (of {best['name']})", knobs)["of"] = best["name"]

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()


def short(knobs: dict[str, Any]) -> str:
    return short_knobs(knobs, ["max_num_seqs", "max_num_batched_tokens", "chunk_size", "block_size"])


def fresh_folder(out: Path) -> Path:
    """The run's folder beside its JSON (``out`` without its suffix), emptied of an earlier run's files."""
    folder = out.with_suffix("")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def run_design(out: Path, policy: Policy, includes: list[Path], simulated: bool) -> dict[str, Any]:
    folder = fresh_folder(out)
    d = Design(policy, folder, simulated)
    t0 = time.monotonic()
    try:
        d.open()
        d.measure("default", {})
        screen_model = (d.profile.rescaled(d.default_steps()) or d.profile) if d.profile is not None else None
        sim = d.runner if simulated else sim_runner_like(d.runner, model=screen_model)
        for name, knobs in entries(policy, sim, folder, includes):
            d.measure(name, knobs)
        d.knockouts()
        d.measure("default-again", {}, like=d.rows[0])  # the same search again: the machine's drift
    finally:
        d.close()
    engine_s = time.monotonic() - t0
    all_steps = [s for r in d.rows for s in engine_steps(folder / r["folder"], int(r["knobs"].get("block_size", 16)))]
    all_model = (d.profile.rescaled(all_steps) or d.profile) if d.profile is not None else None
    for label, model in (("screen", screen_model), ("all_steps", all_model)):
        twin = d.runner if simulated else sim_runner_like(d.runner, model=model)
        for r in d.rows:
            cap = twin_search(twin, policy, r["knobs"], r["capacity"], folder / "twins" / label / r["folder"])
            r.setdefault("predicted", {})[label] = {"req_per_s": cap.value, "bracket": cap.bracket}
    return {"rows": d.rows, "engine_seconds": engine_s, **summary(d.rows)}


def bootstrap_interval(statistic: Any, data: tuple[np.ndarray, ...], seed: int) -> list[float] | None:
    """A percentile bootstrap interval at LEVEL over the configs (paired where ``data`` has two arrays)."""
    if len(data[0]) < 4:
        return None
    res = stats.bootstrap(data, statistic, paired=len(data) > 1, vectorized=False, n_resamples=BOOTSTRAP,
                          confidence_level=LEVEL, method="percentile", rng=np.random.default_rng(seed))
    low, high = res.confidence_interval
    return [float(low), float(high)]


def simulator_error(rows: list[dict[str, Any]], label: str) -> dict[str, Any]:
    """The simulator's capacity error over the design's configs (one row per config: the default's repeat left out)."""
    pairs = [(r["predicted"][label]["req_per_s"], r["req_per_s"]) for r in rows
             if r["name"] != "default-again" and r["req_per_s"] > 0 and label in r.get("predicted", {})]
    pred = np.array([p for p, _ in pairs])
    got = np.array([g for _, g in pairs])
    err = np.abs(pred / got - 1)
    out: dict[str, Any] = {"configs": len(pairs)}
    if len(pairs) < 3:
        return out
    out["median_error"] = float(np.median(err))
    out["median_error_interval"] = bootstrap_interval(np.median, (err,), 1)
    out["p90_error"] = float(np.quantile(err, 0.9))
    out["p90_error_interval"] = bootstrap_interval(lambda e: np.quantile(e, 0.9), (err,), 2)
    out["median_ratio"] = float(np.median(pred / got))  # above 1: the simulator predicts more than the engine serves
    rho = stats.spearmanr(pred, got).statistic
    out["spearman"] = float(rho)
    out["spearman_interval"] = bootstrap_interval(lambda a, b: stats.spearmanr(a, b).statistic, (pred, got), 3)
    return out


def ratio_to(row: dict[str, Any], best: dict[str, Any]) -> dict[str, Any]:
    """``row``'s searched capacity over ``best``'s, and the range their searched brackets allow."""
    lo, hi = row["bracket"]
    b_lo, b_hi = best["bracket"]
    return {"name": row["name"], "ratio": row["req_per_s"] / best["req_per_s"] if best["req_per_s"] else None,
            "range": [lo / b_hi if b_hi else 0.0, (hi / b_lo) if hi and b_lo else None]}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The best config, each included answer and the one-knob baseline against it, the knobs' shares of the gain
    over the default, the simulator's error, and the machine's drift over the run."""
    design = [r for r in rows if r["name"] != "default-again"]
    best = max(design, key=lambda r: r["req_per_s"])
    default = rows[0]
    tied = [r["name"] for r in design if r["bracket"][1] is None or r["bracket"][1] > best["req_per_s"]]
    by_name = {r["name"]: r for r in rows}
    knockouts = []
    for r in rows:
        if "of" in r:  # the share of the knocked-out-of config's gain over the default that this knob carries
            parent = by_name[r["of"]]["req_per_s"]
            over = parent - default["req_per_s"]
            knockouts.append({"name": r["name"], "req_per_s": r["req_per_s"], "of_req_per_s": parent,
                              "share_of_gain_lost": (parent - r["req_per_s"]) / over if over > 0 else None})
    again = next((r for r in rows if r["name"] == "default-again"), None)
    speeds = [r["speed"]["decode"] for r in rows if r.get("speed")]
    return {"best": {"name": best["name"], "knobs": best["knobs"], "req_per_s": best["req_per_s"],
                     "bracket": best["bracket"]},
            "not_below_best": tied,  # configs whose searched bracket does not end below the best's capacity
            "against_best": [ratio_to(r, best) for r in design
                             if r["name"].startswith(("default", "one-knob")) or "tuned:" in r["name"]],
            "knockouts": knockouts,
            "default_first_last": [default["req_per_s"], again["req_per_s"] if again else None],
            "speed_decode_range": [min(speeds), max(speeds)] if speeds else None,
            "simulator_error": {label: simulator_error(rows, label) for label in ("screen", "all_steps")}}


def markdown(result: dict[str, Any]) -> str:
    """The design's rows as a table for BENCHMARKS.md."""
    def bracket(b: list[float | None]) -> str:
        return f"{b[0]:.3g}-{'?' if b[1] is None else f'{b[1]:.3g}'}"

    lines = ["| config | knobs | searched req/s | simulator (default's steps / all steps) | decode speed | minutes |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        pred = r.get("predicted") or {}
        sim = " / ".join(f"{pred[k]['req_per_s']:.3g}" for k in ("screen", "all_steps") if k in pred)
        speed = f"x{r['speed']['decode']:.2f}" if r.get("speed") else "-"
        lines.append(f"| {r['name']} | {short(r['knobs'])} | {bracket(r['bracket'])} | {sim} | {speed} | "
                     f"{r['seconds'] / 60:.1f} |")
    return "\n".join(lines)


def workload_policy(workload: str, trace: Path | None, folder: Path) -> Policy:
    if workload == "mixed":
        return load_policy()
    if trace is None or not trace.is_file():
        raise SystemExit(f"--workload azure needs --trace FILE (the Azure conversation trace CSV); got {trace}")
    doc = yaml.safe_load((REPO / "policies" / "default.yaml").read_text())
    doc["workload"] = {"name": str(trace.resolve()), "length_scale": AZURE_LENGTH_SCALE, "max_context": 2048}
    path = folder.with_suffix(".policy.yaml")
    path.write_text(yaml.safe_dump(doc))
    return load_policy(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("design", "summary"))
    p.add_argument("--workload", choices=("mixed", "azure"), default="mixed")
    p.add_argument("--trace", type=Path, help="azure: the Azure conversation trace (AzureLLMInferenceTrace_conv.csv)")
    p.add_argument("--include", type=Path, nargs="*", default=[], help="design: tuned.yaml files whose config joins")
    p.add_argument("--simulated", action="store_true", help="the simulator stands in for the engine (a check only)")
    p.add_argument("--out", required=True, help="design: the JSON to write; summary: the JSON to read and rewrite")
    a = p.parse_args()
    out = Path(a.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    for path in a.include:
        if not path.is_file():
            raise SystemExit(f"--include: no such tuned.yaml: {path}")
    if a.what == "summary":  # the figures again from a design's rows (after a change to how they are summarised)
        result = json.loads(out.read_text())
        result.update(summary(result["rows"]))
        print(markdown(result))
    else:
        policy = workload_policy(a.workload, a.trace, out.with_suffix(""))
        result = run_design(out, policy, [p.resolve() for p in a.include], a.simulated)
        result.update(workload=a.workload, simulated=a.simulated, design_seed=DESIGN_SEED, draw=DESIGN_DRAW,
                      cpu=cpu_name(), cores=os.cpu_count(), date=time.strftime("%Y-%m-%dT%H:%M:%S"))
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"best: {result['best']['name']} {short(result['best']['knobs'])} {result['best']['req_per_s']:.3g} req/s; "
          f"not below it: {result['not_below_best']}")
    for r in result["against_best"]:
        print(f"  {r['name']}: {r['ratio']:.2f} of the best (brackets allow {r['range']})")
    for label, e in result["simulator_error"].items():
        print(f"simulator ({label}): " + ", ".join(f"{k} {v}" for k, v in e.items()))
    print(f"knock-outs: {result['knockouts']}; default first/last {result['default_first_last']}; "
          f"speed {result['speed_decode_range']}; wrote {out} ({result.get('cpu')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
