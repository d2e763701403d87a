"""tune's answers set against the best config of an engine-measured design (benchmarks/tune_quality.py), and a paired
verdict on whether an answer serves at least SHARE of the best's capacity.

    python benchmarks/quality_answers.py answers --table docs/benchmarks/tune-quality-mixed.json \\
            --out docs/benchmarks/tune-quality-mixed-answers.json [--first K] [--runs N]
        The README's main command once per seed of ANSWER_SEEDS (``--runs N`` of them from the ``--first``, on the
        table's workload); then on a fresh engine the run's tuned config, the table's best and the one-knob baseline
        searched back to back on the design's draws; then the paired verdict of the answer against the best. A table
        on a trace (tune_quality.py design --workload azure) needs the trace here: --trace FILE.
    python benchmarks/quality_answers.py verdict --answers docs/benchmarks/tune-quality-mixed-answers.json \\
            --out docs/benchmarks/tune-quality-mixed-verdict.json
        The paired verdict alone, on a fresh engine, for every run of an answers JSON (its side-by-side brackets).

The paired verdict. A search's bracket on one draw per probe cannot decide a 5 % gap. The verdict asks two
claims, each shown by a pair of pools of measurements (tuner/measure/verdict.py: one confidence sequence per pool):
  - met: the answer shown to serve a and the best shown to miss b, with a >= SHARE x b: then the answer's capacity
    is at least a, above SHARE x the best's;
  - missed: the answer shown to miss a and the best shown to serve b, with a <= SHARE x b.
The pools are those of the routes the side-by-side searches leave possible (the answer at SHARE x r, the best at r):
"met" at r from the best's searched missed rate up to the answer's searched served rate over SHARE, "missed" at r from
the answer's searched missed rate over SHARE up to the best's searched served rate, each at the geometric middle of
that room, off both configs' edges (at the best's own edge where there is none); any answer pool and best pool among
them may then show either claim (a best shown to miss the rate its search served, beside an answer shown to serve
SHARE of it, shows "met"). `verdict` on runs an `answers` run judged already takes fresh draws (REVERDICT_DRAW).
Each measurement is the searches' own (windows of the policy's trial duration in turn, each from an idle engine: the
capacity the design's table holds; a sustained window's capacity is lower, and its rates are not the brackets'),
as many windows as show the share served at the pool's level (half as many to show it missed), stopped once decided.
Each round the two configs alternate (which goes first alternates too) on one fresh arrival draw, so that a drift of
the machine's speed meets both; a pool is measured while a pair it belongs to can still show its claim and it is
undecided. One error budget: only one of the claims can be wrong, and a wrong one needs one of the four pools shown
the wrong way on the side that claim reads (a wrong "met": an answer pool wrongly served or a best pool wrongly
missed), each pool judged at pool_level(LEVEL, 2), one-sided error (1 - LEVEL) / 4: at most 1 - LEVEL whichever
pair shows it. Beside the verdict: the capacities' ratio from shown bounds only (an end not shown stays open).

The seeds and draws are fixed here, before the runs; none was used while developing; every run made is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Literal

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tune_quality import ONE_KNOB_CHUNK, Design, ratio_to, short  # noqa: E402  (a sibling script)

from engine.cpu_info import cpu_name  # noqa: E402
from policies import Policy, load_policy  # noqa: E402
from tuner.measure.capacity import Ratio, measurement_spec  # noqa: E402
from tuner.measure.measurement import MeasurementSpec, measure  # noqa: E402
from tuner.measure.verdict import Contender, pool_level  # noqa: E402
from tuner.measure.verdict_plan import SHOW_MARGIN, sample_of  # noqa: E402
from tuner.search.design import config_key  # noqa: E402

# the tune runs set against a table, fixed before the runs: 61-63 ran on both workloads first; 64-66 were declared
# after the segment and step-down changes, for the runs of the code that has them (--first 3); 67-69 after the
# winner's climbs and the step down to the middle (--first 6); 70-72 after the candidate shown to attain more is
# written where nothing is shown served and a round that does not fit whole drops the default's ceiling (--first 9);
# 73-75 after a winner two steps below its searched capacity climbs and an undecidable ceiling is left (--first 12)
ANSWER_SEEDS = (61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75)
SHARE = 0.95  # the answer is good enough when it serves this share of the best's capacity
LEVEL = 0.95
VERDICT_DRAW = 1700  # round i on arrival draw VERDICT_DRAW + i (tune's runs use draws below 1400, the design 1500+)
REVERDICT_DRAW = 1800  # `verdict` again on runs an `answers` run judged already: fresh draws, not the first verdict's
DEV_DRAW = 9000  # the simulated check's draws (never the evaluation's)
MAX_ROUNDS = 2
POOL_LEVEL = pool_level(LEVEL, 2)  # a wrong verdict needs one wrong pool of four: each pool's one-sided error 1.25 %
Claim = Literal["met", "missed"]
Measure = Callable[[Contender, float, int], Any]  # (config, rate, draw) -> tuner.measure.verdict.Sample


@dataclass
class Route:
    """One claim the side-by-side searches leave possible: the answer at SHARE x ``rate``, the best at ``rate``. Its
    two pools join the verdict's; any answer pool and best pool of the verdict may then show a claim (:class:`Pair`)."""

    claim: Claim
    rate: float

    @property
    def answer_rate(self) -> float:
        return SHARE * self.rate

    def verdicts(self, answer: Contender, best: Contender) -> tuple[str, str]:
        return verdict_at(answer, self.answer_rate), verdict_at(best, self.rate)


@dataclass(frozen=True)
class Pair:
    """A claim from one answer pool (at ``answer_rate``) and one best pool (at ``best_rate``): "met" when the answer is
    shown to serve its rate and the best to miss its own, with answer_rate >= SHARE x best_rate (the answer's capacity
    is then at least answer_rate, above SHARE x the best's); "missed" the other way round, with answer_rate <= SHARE x
    best_rate."""

    claim: Claim
    answer_rate: float
    best_rate: float

    def wanted(self) -> tuple[str, str]:
        """The verdicts (the answer's, the best's) the claim needs."""
        return ("met", "missed") if self.claim == "met" else ("missed", "met")

    def verdicts(self, answer: Contender, best: Contender) -> tuple[str, str]:
        return verdict_at(answer, self.answer_rate), verdict_at(best, self.best_rate)

    def shown(self, answer: Contender, best: Contender) -> bool:
        return self.verdicts(answer, best) == self.wanted()

    def possible(self, answer: Contender, best: Contender) -> bool:
        """Neither pool decided the other way."""
        return all(v in ("undecided", w) for v, w in zip(self.verdicts(answer, best), self.wanted()))


def verdict_at(c: Contender, rate: float) -> str:
    pool = c.pool(rate)
    return pool.verdict() if pool else "undecided"


def pairs(asked: list[Route]) -> list[Pair]:
    """Every claim the asked routes' pools can show together: each route's own two pools, and across routes a pair
    whose rates still order the capacities (a best shown to miss the rate its search served, say, beside an answer
    shown to serve SHARE of it: the dropped "missed" becomes a "met")."""
    answers, bests = sorted({r.answer_rate for r in asked}), sorted({r.rate for r in asked})
    return [Pair(claim, a, b) for claim in ("met", "missed") for a in answers for b in bests
            if (a >= SHARE * b * (1 - 1e-9) if claim == "met" else a <= SHARE * b * (1 + 1e-9))]


def routes(answer_bracket: list[float | None], best_bracket: list[float | None]) -> list[Route]:
    """The claims the side-by-side searches leave possible: met where the best missed a rate whose SHARE the answer's
    search did not miss below; missed where the best served a rate whose SHARE the answer's search did not serve.
    Where the searches leave room, a claim's rate sits in the middle of it, off both configs' edges: "met" between
    the best's missed rate and the answer's served one over SHARE, "missed" between the answer's missed rate over
    SHARE and the best's served one (the geometric middle). At the best's own edge, a claim fails on the search's
    luck alone: one answer at 0.21 of the best went undecided, the best at 78-92 % at the rate its search served."""
    a_lo, a_hi = float(answer_bracket[0] or 0.0), answer_bracket[1]
    b_lo, b_hi = float(best_bracket[0] or 0.0), best_bracket[1]
    out = []
    if b_hi is not None and (a_hi is None or a_hi > SHARE * b_hi):
        top = a_lo / SHARE  # the answer served SHARE of every rate up to this
        out.append(Route("met", math.sqrt(b_hi * top) if top > b_hi else float(b_hi)))
    if b_lo > 0 and a_lo < SHARE * b_lo:
        bottom = a_hi / SHARE if a_hi is not None else math.inf  # the answer missed SHARE of every rate from this
        out.append(Route("missed", math.sqrt(bottom * b_lo) if bottom < b_lo else b_lo))
    return out


def ratio(answer: Contender, best: Contender) -> Ratio:
    """The capacities' ratio from the verdict's shown bounds: the answer's served over the best's missed, the
    answer's missed over the best's served."""
    return Ratio.of(answer.shown(), best.shown())


def paired_verdict(answer: Contender, best: Contender, asked: list[Route], measure_at: Measure,
                   max_rounds: int = MAX_ROUNDS, draw0: int = VERDICT_DRAW) -> dict[str, Any]:
    """Rounds of the open pairs' undecided pools, the configs alternating on one draw per round, until a claim is
    shown or no pair is left open; the verdict (met, missed, undecided; contradictory should both be shown), the
    routes, the pair that showed it, and the ratio from shown bounds."""
    rounds, every = 0, pairs(asked)
    for i in range(max_rounds):
        open_pairs = [q for q in every if q.possible(answer, best) and not q.shown(answer, best)]
        if not open_pairs or any(q.shown(answer, best) for q in every):
            break
        rounds += 1
        todo: list[tuple[Contender, float]] = []
        for q in open_pairs:
            got_a, got_b = q.verdicts(answer, best)
            for c, rate, got in ((answer, q.answer_rate, got_a), (best, q.best_rate, got_b)):
                if got == "undecided" and not any(c is t and rate == r for t, r in todo):
                    todo.append((c, rate))
        first = answer if i % 2 == 0 else best
        todo.sort(key=lambda pair: pair[0] is not first)
        for c, rate in todo:
            c.add(measure_at(c, rate, draw0 + i), POOL_LEVEL)
    shown = [q for q in every if q.shown(answer, best)]
    claims = sorted({q.claim for q in shown})
    verdict = claims[0] if len(claims) == 1 else ("contradictory" if claims else "undecided")
    return {"verdict": verdict, "share": SHARE, "level": LEVEL, "pool_level": POOL_LEVEL, "rounds": rounds,
            "routes": [{"claim": r.claim, "best_rate": r.rate, "answer_rate": r.answer_rate,
                        "verdicts": list(r.verdicts(answer, best))} for r in asked],
            "shown_by": [{"claim": q.claim, "answer_rate": q.answer_rate, "best_rate": q.best_rate} for q in shown],
            "ratio": ratio(answer, best).as_dict(), "answer": answer.as_dict(), "best": best.as_dict()}


def verdict_spec(policy: Policy, level: float, rate: float, serving: bool) -> MeasurementSpec:
    """The searches' own measurement (windows of the policy's trial duration in turn, each from an idle engine: the
    capacity the design measures), judged at ``level``, its cap as many windows as hold the blocks that show the
    share served when every block attains (and a quarter more); to show missed, half as many."""
    spec = replace(measurement_spec(policy), level=level)
    windows = math.ceil(spec.seconds_to_show(rate, SHOW_MARGIN / (1 if serving else 2)) / spec.window_s - 1e-9)
    return replace(spec, max_segments=max(spec.max_segments, windows))


def run_verdict(d: Design, answer_row: dict[str, Any], best_row: dict[str, Any], draw0: int) -> dict[str, Any]:
    """The paired verdict of the answer against the best on ``d``'s engine, after their side-by-side searches."""
    answer = Contender("answer", answer_row["knobs"], answer_row["req_per_s"])
    best = Contender("best", best_row["knobs"], best_row["req_per_s"])
    asked = routes(answer_row["bracket"], best_row["bracket"])
    every = pairs(asked)

    def serving(c: Contender, rate: float) -> bool:
        """Whether an open pair wants the pool shown served (its window sized for that, else for a miss)."""
        return any(q.possible(answer, best) and (q.answer_rate if c is answer else q.best_rate) == rate
                   and q.wanted()[0 if c is answer else 1] == "met" for q in every)

    def measure_at(c: Contender, rate: float, draw: int) -> Any:
        folder = d.folder / "verdict" / f"draw-{draw}" / c.name / f"rate-{rate:.4g}"
        m = measure(d.runner, c.knobs, rate, folder, draw, verdict_spec(d.policy, POOL_LEVEL, rate, serving(c, rate)))
        print(f"  verdict: {c.name} at {rate:.3g} req/s on draw {draw}: {m.describe()}", flush=True)
        return sample_of(m, draw)

    out = paired_verdict(answer, best, asked, measure_at, draw0=draw0)
    print(f"  paired verdict (answer >= {SHARE:.0%} of the best): {out['verdict']}; ratio from shown bounds "
          f"{ratio(answer, best).format()}", flush=True)
    return out


def side_by_side(d: Design, tuned: dict[str, Any], table: dict[str, Any], claim: float | None) -> list[dict[str, Any]]:
    """The answer, the table's best and the one-knob baseline searched back to back on ``d``'s engine. A config the
    table holds is searched as the table searched it (its first rate and step, on the same draws); the answer, when
    the table lacks it, from the capacity ``tune`` searched for it at the table's step. (From the nearest config
    searched instead, the best's five probes climbed from the default's 0.65 req/s to 3.28 and never read a miss.)"""
    best = table["best"]
    by_key = {config_key(r["knobs"]): r for r in table["rows"]}
    step = float(by_key[config_key(best["knobs"])]["capacity"]["step"])

    def like(knobs: dict[str, Any], fallback: float | None = None) -> dict[str, Any] | None:
        row = by_key.get(config_key({**d.base, **knobs}))
        if row is not None:
            return row
        return {"capacity": {"start": fallback, "step": step}} if fallback else None

    same = config_key({**d.base, **tuned}) == config_key(best["knobs"])
    rows = [d.measure("answer" + (" = best" if same else ""), tuned, like(tuned, claim))]
    if not same:
        rows.append(d.measure("best", best["knobs"], like(best["knobs"])))
    one_knob = {"chunk_size": ONE_KNOB_CHUNK}
    if any(r["name"] == "one-knob" for r in table["rows"]):  # how much of the gain a small chunk brings
        rows.append(d.measure("one-knob", one_knob, like(one_knob)))
    return rows


def compare(rows: list[dict[str, Any]], table_best: dict[str, Any], shown_low: float) -> dict[str, Any]:
    answer, best = rows[0], next((r for r in rows if r["name"] == "best"), rows[0])
    one_knob = next((r for r in rows if r["name"] == "one-knob"), None)
    return {"rows": rows, "answer_over_best": ratio_to(answer, best),
            "one_knob_over_best": ratio_to(one_knob, best) if one_knob else None,
            "answer_over_table_best": ratio_to(answer, table_best),
            "shown_over_best": shown_low / best["req_per_s"] if best["req_per_s"] else None}


def table_policy(table_path: Path, table: dict[str, Any], trace: Path | None, folder: Path) -> Path | None:
    """The policy a table was measured under (None: the shipped one, on mixed), its trace read from ``trace`` when the
    recorded one is not on this machine (the committed tables name it TRACES/...), written into ``folder``."""
    if table["workload"] == "mixed":
        return None
    doc = yaml.safe_load(table_path.with_suffix(".policy.yaml").read_text())
    recorded = Path(doc["workload"]["name"])
    if trace is None and not recorded.is_file():
        raise SystemExit(f"the table's trace {recorded} is not here: give --trace FILE")
    doc["workload"]["name"] = str((trace or recorded).resolve())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "policy.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def answers(table_path: Path, out: Path, runs_wanted: int, first: int, trace: Path | None) -> dict[str, Any]:
    """tune once per ANSWER_SEEDS (``runs_wanted`` of them from the ``first``, in their order); each answer, the
    table's best and the one-knob baseline then searched side by side on a fresh engine, and the paired verdict."""
    from tune_evidence import run_tune  # a sibling script: the README's main command in a fresh folder

    table = json.loads(table_path.read_text())
    base = out.with_suffix("")
    policy_file = table_policy(table_path, table, trace, base)
    extra = [] if policy_file is None else ["--policy", str(policy_file)]
    policy = load_policy(policy_file)
    result: dict[str, Any] = {"table": str(table_path), "best": table["best"], "runs": [], "seeds": list(ANSWER_SEEDS)}
    for i, seed in list(enumerate(ANSWER_SEEDS))[first:first + runs_wanted]:
        run = run_tune(base / f"run-{i}", ["--seed", str(seed), *extra]) | {"seed": seed}
        print(f"seed {seed}: rc {run['rc']} in {run['seconds']:.0f}s: {run['last_line']}", flush=True)
        tuned = (run.get("tuned") or {}).get("knobs")
        if tuned:
            d = Design(policy, base / f"run-{i}" / "side-by-side", simulated=False)
            d.folder.mkdir(parents=True, exist_ok=True)
            try:
                d.open()
                rows = side_by_side(d, tuned, table, (run.get("tuned") or {}).get("searched_req_per_s"))
                shown_low = float(((run["tuned"].get("capacity_req_per_s") or {}).get("bracket") or [0.0])[0] or 0)
                run["side_by_side"] = compare(rows, table["best"], shown_low)
                print(f"  answer over best, side by side: {run['side_by_side']['answer_over_best']}; shown over "
                      f"best: {run['side_by_side']['shown_over_best']}", flush=True)
                if rows[1]["name"] == "best":
                    run["paired_verdict"] = run_verdict(d, rows[0], rows[1], VERDICT_DRAW)
            finally:
                d.close()
        result["runs"].append(run)
        write(out, result)  # after each run: a session that ends early keeps the runs it made
    return result


def verdicts(answers_path: Path, out: Path, simulated: bool, trace: Path | None) -> dict[str, Any]:
    """The paired verdict alone for each run of an answers JSON that has side-by-side rows, on one fresh engine; on
    REVERDICT_DRAW's draws where the answers run judged them already (VERDICT_DRAW's)."""
    doc = json.loads(answers_path.read_text())
    table_path = REPO / doc["table"]  # as the answers run named it: relative to the repository, or absolute
    table = json.loads(table_path.read_text())
    policy = load_policy(table_policy(table_path, table, trace, out.with_suffix("")))
    result: dict[str, Any] = {"answers": str(answers_path), "simulated": simulated, "runs": []}
    d = Design(policy, out.with_suffix(""), simulated=simulated)
    d.folder.mkdir(parents=True, exist_ok=True)
    try:
        d.open()
        for run in doc["runs"]:
            rows = (run.get("side_by_side") or {}).get("rows") or []
            if len(rows) < 2 or rows[1]["name"] != "best":
                continue
            print(f"seed {run['seed']}: answer {short(rows[0]['knobs'])}, best {short(rows[1]['knobs'])}", flush=True)
            d.folder = out.with_suffix("") / f"seed-{run['seed']}"
            judged = run.get("paired_verdict") is not None
            draw = DEV_DRAW if simulated else REVERDICT_DRAW if judged else VERDICT_DRAW
            verdict = run_verdict(d, rows[0], rows[1], draw)
            result["runs"].append({"seed": run["seed"], "first_draw": draw, "paired_verdict": verdict})
            write(out, result)
    finally:
        d.close()
    return result


def write(out: Path, result: dict[str, Any]) -> None:
    out.write_text(json.dumps(result | {"cpu": cpu_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1,
                              default=str) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("answers", "verdict"))
    p.add_argument("--table", type=Path, help="answers: the design's JSON whose best the answers are set against")
    p.add_argument("--answers", type=Path, help="verdict: an answers JSON whose runs are judged")
    p.add_argument("--runs", type=int, default=3, help="answers: how many declared seeds to run (one set of three)")
    p.add_argument("--first", type=int, default=0, help="answers: the index of the first declared seed to run")
    p.add_argument("--trace", type=Path, help="a table on a trace: the trace file on this machine")
    p.add_argument("--simulated", action="store_true", help="verdict: the simulator stands in (a check, not evidence)")
    p.add_argument("--out", type=Path, required=True, help="the JSON to write")
    a = p.parse_args()
    out = a.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    given = a.table if a.what == "answers" else a.answers
    if given is None or not given.is_file():
        raise SystemExit(f"{a.what} needs --{'table' if a.what == 'answers' else 'answers'} FILE; got {given}")
    if a.what == "answers":
        answers(a.table.resolve(), out, a.runs, a.first, a.trace)
    else:
        verdicts(a.answers.resolve(), out, a.simulated, a.trace)
    print(f"wrote {out} ({cpu_name()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
