"""The leading configs of a design and tune's answers, each searched several times: is an answer within 95 % of the
best once one search's luck is averaged out?

    python benchmarks/tune_quality_repeats.py repeats --source docs/benchmarks/tune-quality-azure-remeasured.json \\
            --workload azure --trace TRACES/azure2023/AzureLLMInferenceTrace_conv.csv \\
            --out docs/benchmarks/tune-quality-azure-repeats.json --include <tuned.yaml ...>
        One engine (the source design's workload and policy) searches, in each of REPEATS rounds, the LEADERS configs
        the source design searched highest and every --include (a tune run's tuned config), each config once (the
        first name it was given stands). Every search in a round is on the same arrival draws (round r: REPEAT_DRAW
        + ROUND_DRAWS r, probe i one further), so that the configs of a round are compared on the same arrivals; the
        rounds take fresh draws, so that a config's spread over the rounds holds the draws' luck with the machine's.
        The order alternates (forward, backward, ...), so that a drift of the machine's speed over a round does not
        favour the configs searched first. Every search starts at the same rate with the same step (the geometric mean
        of the chosen configs' searched capacities in the source design, step STEP), so no search's path hangs on
        which config went before it.
        Then each config's searched capacities over the rounds (median, geometric mean, range); one search's spread
        (the pooled standard deviation of log capacity over the rounds); the rounds' rank agreement (Spearman of each
        pair of rounds); and each config against two references: the source design's best (chosen on other draws, so
        its repeats are not selected for luck) and the best median here (selected on these searches: its repeats lean
        high, and every ratio to it leans low). Against each: the per-round ratio on the same draws, their geometric
        mean and a t interval at LEVEL over the rounds (log ratios); and "met", "missed" or "undecided" on SHARE from
        the same t intervals taken over each round's least and largest ratio its brackets allow (a searched capacity
        is known only to its bracket, 10-15 % wide: three searches alike do not show a 5 % gap closed).
    python benchmarks/tune_quality_repeats.py --simulated repeats --source ... --out /tmp/r.json
        The same with the simulator standing in for the engine, on development draws (a check of the script only).

The draws and counts are fixed here, before the runs; none was used while developing; every run made is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from scipy import stats

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quality_answers import LEVEL, SHARE  # noqa: E402  (sibling scripts)
from tune_quality import Design, fresh_folder, short, workload_policy  # noqa: E402

from engine.cpu_info import cpu_name  # noqa: E402
from tuner.search.design import config_key  # noqa: E402

REPEATS = 3  # searches of each config
LEADERS = 5  # the source design's highest configs searched again
REPEAT_DRAW = 2000  # round r on draws from REPEAT_DRAW + ROUND_DRAWS r (tune <1400, design 1500+, verdicts 1700-1899)
ROUND_DRAWS = 10  # a search takes at most the policy's probes (6) draws
DEV_DRAW = 9000  # the simulated check's draws (never the evaluation's)
STEP = 1.5  # every search's step from the common start


def chosen(source: dict[str, Any], leaders: int, includes: list[Path]) -> list[tuple[str, dict[str, Any]]]:
    """The source design's ``leaders`` highest configs (its repeat of the default left out), then each included
    answer; each config once, under every name it was given."""
    rows = sorted((r for r in source["rows"] if r["name"] != "default-again"), key=lambda r: -r["req_per_s"])
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for r in rows:
        if len(out) == leaders:
            break
        out.setdefault(config_key(r["knobs"]), (r["name"].split(" ")[0], r["knobs"]))
    for path in includes:
        knobs = yaml.safe_load(path.read_text())["tuned"]["knobs"]
        name = f"tuned:{path.parent.name}"
        key = config_key(knobs)
        if key not in out:
            out[key] = (name, knobs)
        elif name not in out[key][0].split(" = "):
            out[key] = (f"{out[key][0]} = {name}", out[key][1])
    return list(out.values())


def common_start(source: dict[str, Any], configs: list[tuple[str, dict[str, Any]]]) -> float:
    """The geometric mean of the chosen configs' searched capacities in the source design (those it searched)."""
    searched = {config_key(r["knobs"]): r["req_per_s"] for r in source["rows"] if r["req_per_s"] > 0}
    values = [searched[config_key(k)] for _, k in configs if config_key(k) in searched]
    if not values:
        raise SystemExit("--source: none of the chosen configs has a searched capacity there; give --start")
    return float(np.exp(np.mean(np.log(values))))


def reference_name(source: dict[str, Any], configs: list[tuple[str, dict[str, Any]]]) -> str:
    """The name this run gives the source design's best config (always among the leaders)."""
    key = config_key(chosen(source, 1, [])[0][1])
    return next(name for name, knobs in configs if config_key(knobs) == key)


def round_order(n: int, r: int) -> list[int]:
    """The configs' order in round ``r``: forward in even rounds, backward in odd ones."""
    return list(range(n)) if r % 2 == 0 else list(range(n - 1, -1, -1))


def t_interval(logs: list[float]) -> tuple[float, float]:
    """A t interval at LEVEL for the mean of ``logs`` (two or more), as (low, high) on the log scale."""
    mean, sd = float(np.mean(logs)), float(np.std(logs, ddof=1))
    half = float(stats.t.ppf(0.5 + LEVEL / 2, len(logs) - 1)) * sd / math.sqrt(len(logs))
    return mean - half, mean + half


def paired(mine: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, Any]:
    """``mine``'s searches over ``reference``'s round by round (the same draws): the ratios of the searched
    capacities, their geometric mean and a t interval at LEVEL over the rounds; and the verdict on SHARE, which also
    allows for the searches' resolution (a searched capacity is only known to lie in its bracket): "met" needs the t
    interval of each round's least ratio (mine's served rate over the reference's missed rate) above SHARE, "missed"
    that of each round's largest ratio (mine's missed rate over the reference's served rate) below it."""
    ratios = [m["req_per_s"] / r["req_per_s"] if r["req_per_s"] > 0 else math.nan for m, r in zip(mine, reference)]
    out: dict[str, Any] = {"ratios": ratios, "ratio": None, "interval": None, "allowed": None}
    if any(not math.isfinite(x) or x <= 0 for x in ratios):  # a search that served nothing: no log ratio
        out.update(verdict="undecided", why="a round's search served nothing: the ratios alone, no interval")
        return out
    out["ratio"] = math.exp(float(np.mean(np.log(ratios))))
    if len(ratios) < 2:
        out.update(verdict="undecided", why="one round")
        return out
    out["interval"] = [math.exp(x) for x in t_interval(list(np.log(ratios)))]
    least = [m["req_per_s"] / r["bracket"][1] if r["bracket"][1] else 0.0 for m, r in zip(mine, reference)]
    most = [m["bracket"][1] / r["req_per_s"] if m["bracket"][1] else math.inf for m, r in zip(mine, reference)]
    low = math.exp(t_interval(list(np.log(least)))[0]) if min(least) > 0 else 0.0
    high = math.exp(t_interval(list(np.log(most)))[1]) if max(most) < math.inf else math.inf
    out["allowed"] = [low, high if math.isfinite(high) else None]
    out["verdict"] = "met" if low >= SHARE else "missed" if high < SHARE else "undecided"
    return out


def summary(rows: list[dict[str, Any]], reference_name: str | None) -> dict[str, Any]:
    """Each config's searched capacities over the rounds, one search's spread, the rounds' rank agreement, and each
    config against the named reference (the source design's best) and against the best median here."""
    names = list(dict.fromkeys(r["name"] for r in rows))
    rounds = sorted({r["round"] for r in rows})
    search = {(r["name"], r["round"]): r for r in rows}
    searches = {n: [search[(n, k)] for k in rounds if (n, k) in search] for n in names}
    by = {n: [r["req_per_s"] for r in searches[n]] for n in names}
    complete = [n for n in names if len(by[n]) == len(rounds)]
    configs = []
    for n in names:
        v = by[n]
        positive = [x for x in v if x > 0]
        configs.append({"name": n, "req_per_s": v, "median": float(np.median(v)) if v else None,
                        "geometric_mean": float(np.exp(np.mean(np.log(positive)))) if positive == v and v else None,
                        "range": [min(v), max(v)] if v else None})
    spreads = [float(np.var(np.log(by[n]), ddof=1)) for n in complete if min(by[n]) > 0 and len(by[n]) > 1]
    sd = math.sqrt(float(np.mean(spreads))) if spreads else None
    pairs = [(i, j) for i in range(len(rounds)) for j in range(i + 1, len(rounds))] if len(complete) > 2 else []
    rhos = [stats.spearmanr([by[n][i] for n in complete], [by[n][j] for n in complete]).statistic for i, j in pairs]
    agree = [float(rho) if math.isfinite(rho) else None for rho in rhos]  # None: a round with every config tied
    median_of = {c["name"]: c["median"] for c in configs if c["name"] in complete}
    best = max(median_of, key=lambda n: (median_of[n], np.mean(by[n]))) if median_of else None
    out: dict[str, Any] = {
        "configs": configs, "rounds": len(rounds),
        "one_search_log_sd": sd,  # a single search's spread: its 95 % range is x/ exp(1.96 sd) around the truth
        "one_search_factor_95": math.exp(1.96 * sd) if sd is not None else None,
        "rounds_spearman": agree, "best_median": best, "reference": reference_name}
    for label, ref in (("against_reference", reference_name), ("against_best_median", best)):
        if ref is None or ref not in complete:
            continue
        out[label] = [{"name": n, **paired(searches[n], searches[ref])} for n in complete if n != ref]
    return out


def run_repeats(out: Path, policy: Any, configs: list[tuple[str, dict[str, Any]]], repeats: int, start: float,
                draw: int, simulated: bool) -> dict[str, Any]:
    d = Design(policy, fresh_folder(out), simulated)
    t0 = time.monotonic()
    try:
        d.open()
        for r in range(repeats):
            for i in round_order(len(configs), r):
                name, knobs = configs[i]
                row = d.measure(name, knobs, draw=draw + ROUND_DRAWS * r, first=(start, STEP))
                row.update(round=r, draw=draw + ROUND_DRAWS * r)
    finally:
        d.close()
    return {"rows": d.rows, "engine_seconds": time.monotonic() - t0}


def allowed(against: dict[str, Any] | None) -> str:
    if against is None or against["allowed"] is None:
        return "-"
    low, high = against["allowed"]
    return f"{low:.2f}-{'?' if high is None else f'{high:.2f}'}"


def markdown(result: dict[str, Any]) -> str:
    """The configs' searched capacities over the rounds and their ratios to the reference, for BENCHMARKS.md."""
    against = {a["name"]: a for a in result.get("against_reference", [])}
    lines = ["| config | knobs | searched req/s by round | median | over the reference (95 % t interval) | "
             "allowed by the brackets | verdict |", "|---|---|---|---|---|---|---|"]
    knobs = {r["name"]: r["knobs"] for r in result["rows"]}
    for c in result["configs"]:
        a = against.get(c["name"])
        ratio = "reference" if a is None else (f"{a['ratio']:.2f}" if a["ratio"] is not None else "-") + (
            f" ({a['interval'][0]:.2f}-{a['interval'][1]:.2f})" if a and a.get("interval") else "")
        lines.append(f"| {c['name']} | {short(knobs[c['name']])} | {', '.join(f'{v:.3g}' for v in c['req_per_s'])} | "
                     f"{c['median']:.3g} | {ratio} | {allowed(a)} | {a['verdict'] if a else '-'} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("repeats", "summary"))
    p.add_argument("--source", type=Path, help="repeats: the design JSON (tune_quality.py design) to draw leaders from")
    p.add_argument("--workload", choices=("mixed", "azure"), default="mixed")
    p.add_argument("--trace", type=Path, help="azure: the Azure conversation trace (AzureLLMInferenceTrace_conv.csv)")
    p.add_argument("--include", type=Path, nargs="*", default=[], help="repeats: tuned.yaml files whose config joins")
    p.add_argument("--leaders", type=int, default=LEADERS, help="the source design's highest configs searched again")
    p.add_argument("--repeats", type=int, default=REPEATS, help="searches of each config (rounds)")
    p.add_argument("--start", type=float, help="every search's first rate (default: from the source design)")
    p.add_argument("--simulated", action="store_true", help="the simulator stands in for the engine (a check only)")
    p.add_argument("--out", required=True, help="repeats: the JSON to write; summary: the JSON to read and rewrite")
    a = p.parse_args()
    out = Path(a.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.what == "summary":  # the figures again from a run's rows (after a change to how they are summarised)
        result = json.loads(out.read_text())
    else:
        if a.source is None or not a.source.is_file():
            raise SystemExit(f"repeats needs --source DESIGN.json (tune_quality.py design's output); got {a.source}")
        if a.repeats < 2 or a.leaders < 1:
            raise SystemExit(f"--repeats must be at least 2 and --leaders at least 1; got {a.repeats}, {a.leaders}")
        for path in a.include:
            if not path.is_file():
                raise SystemExit(f"--include: no such tuned.yaml: {path}")
        source = json.loads(a.source.read_text())
        configs = chosen(source, a.leaders, [q.resolve() for q in a.include])
        start = a.start if a.start is not None else common_start(source, configs)
        policy = workload_policy(a.workload, a.trace, out.with_suffix(""))
        draw = DEV_DRAW if a.simulated else REPEAT_DRAW
        print(f"{len(configs)} configs x {a.repeats} rounds from {start:.3g} req/s (step {STEP}), draws from {draw}: "
              + "; ".join(f"{n} {short(k)}" for n, k in configs), flush=True)
        result = run_repeats(out, policy, configs, a.repeats, start, draw, a.simulated)
        result.update(workload=a.workload, simulated=a.simulated, source=str(a.source), start=start, step=STEP,
                      draw=draw, reference=reference_name(source, configs), cpu=cpu_name(), cores=os.cpu_count(),
                      date=time.strftime("%Y-%m-%dT%H:%M:%S"))
    result.update(summary(result["rows"], result.get("reference")))
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(markdown(result))
    print(f"best median: {result['best_median']}; one search's spread x/ {result['one_search_factor_95']}; "
          f"rounds' Spearman {result['rounds_spearman']}; wrote {out} ({result.get('cpu')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
