"""A two-phase traffic shift on the default engine: SLO attainment over time for the engine's default config, for
the config tuned for phase one, and for the controller (``slotune control`` starting from the phase-one config).

    PYTHONPATH=. python benchmarks/controller_shift.py --out build/controller-shift            # 2 x 5 min per arm (~40 min)
    PYTHONPATH=. python benchmarks/controller_shift.py --phase-seconds 60 --out /tmp/shift     # a short look (~10 min)
    PYTHONPATH=. python benchmarks/controller_shift.py --out build/controller-shift --rerun controller  # one arm again
    PYTHONPATH=. python benchmarks/controller_shift.py --arms controller --rate2 0.4 --phase-seconds 600 \
        --out build/controller-stationary        # stationary traffic for 20 minutes: the controller should not move

Each arm gets a fresh engine and the same two Locust runs back to back (same seeds: the same arrival draws):
phase one ``--mix`` at ``--rate``, phase two ``--mix2`` (default: the same mix) at ``--rate2`` (default: four
times the rate). Attainment
per request (a request attains when its TTFT and its own p99 gap are within the SLO; failed or unfinished requests
do not) is binned by intended send time; each phase is summarized after the settling time (``--settle``) with its Clopper-Pearson
interval, and goodput (attaining requests/s) is compared with the best static arm of that phase. Writes
OUT/controller_shift.json, OUT/controller_shift.html and OUT/controller_shift.png (the HTML shot in headless
Chromium) and prints a summary. The machine's CPU is recorded in the JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from engine.cpu_info import cpu_name
from loadtest.records import RequestRecord, read_records
from loadtest.workloads import parse_mix
from slotune.slo import SLO
from loadtest.summary import attains
from tuner.trials.engine_handle import ManagedEngine
from tuner.measure.statistics import proportion_interval

REPO = Path(__file__).resolve().parents[1]

PHASE_ONE_CONFIG = {"max_num_seqs": 2, "max_num_batched_tokens": 64, "chunk_size": 32, "block_size": 16}
POLICY: dict[str, Any] = {
    "slo": {"tbt_p99": "250ms", "ttft_p99": "3s"},
    "search_space": {"max_num_seqs": {"low": 1, "high": 32, "log": True},
                     "max_num_batched_tokens": {"choices": [32, 64, 128, 256, 512]},
                     "chunk_size": {"choices": [16, 32, 64, 128]},
                     "block_size": {"choices": [8, 16, 32]}},
    "constraints": ["chunk_size <= max_num_batched_tokens", "max_num_seqs <= max_num_batched_tokens"],
    "guardrails": {"default_max_change": 4, "cooldown": "15s"},
    "triggers": {"attainment_target": 0.9, "window": "30s", "min_requests": 20, "drift_threshold": 0.3,
                 "drift_window": "30s"},
    "canary": {"block": "20s", "settle": "8s", "level": 0.05, "max_window": "400s", "lease_margin": "20s",
               "rollback_drop": 0.15},
    "retune": {"candidates": 32, "headroom": 1.25, "sim_duration": "20s", "step_history": "120s"},
}


ARMS = ("default", "phase1_tuned", "controller")
SHIFT_LOAD = 1.5  # --rate2 auto: phase two's rate over what the phase-one config finishes of its requests


def calibrated_rate(mix: str, phase_one: dict[str, Any]) -> dict[str, Any]:
    """Phase two's rate on this machine (``--rate2 auto``): SHIFT_LOAD times what the phase-one config finishes of
    phase two's outputs with all its sequences busy, on a fresh engine; and what the policy's most sequences finish,
    for the record (a machine where they finish too little more has no config that serves the shift)."""
    output = max(c.output[1] for c in parse_mix(mix, ":".join("1" for _ in mix.split(","))))
    most = int(POLICY["search_space"]["max_num_seqs"]["high"])
    with ManagedEngine(knobs=phase_one) as handle:
        few = handle.finishing_rate(int(phase_one["max_num_seqs"]), output)
        handle.patch_config({"max_num_seqs": most, "max_num_batched_tokens": max(most, 64)})
        many = handle.finishing_rate(most, output)
    return {"rate2": round(SHIFT_LOAD * few, 3), "output_tokens": output, "phase_one_rps": round(few, 3),
            "most_sequences": most, "most_sequences_rps": round(many, 3)}


@dataclass
class Arm:
    name: str
    knobs: dict[str, Any]
    controlled: bool = False


def run_phase(url: str, out: Path, mix: str, rate: float, seconds: float, seed: int, slo: SLO) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "slotune.cli", "loadtest", "--url", url, "--workload", "mixed", "--mix", mix,
           "--mix-weights", "1", "--rate", str(rate), "--duration", f"{seconds}s", "--seed", str(seed),
           "--out", str(out), "--slo-p99-tbt", f"{slo.tbt_p99}s", "--slo-p99-ttft", f"{slo.ttft_p99}s",
           "--drain-timeout", "60s"]
    with open(out.with_suffix(".log"), "w") as err:
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=err)
    return json.loads((out / "summary.json").read_text())


def run_arm(arm: Arm, args: argparse.Namespace, out: Path, slo: SLO) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    engine = ManagedEngine(knobs=arm.knobs, log_path=str(out / "engine.log"))
    handle = engine.start()
    controller = None
    try:
        if arm.controlled:
            (out / "policy.yaml").write_text(yaml.safe_dump(policy_for(slo)))
            (out / "controller.jsonl").unlink(missing_ok=True)  # a fresh controller, not one resumed from a rerun's log
            with open(out / "controller.err", "w") as err:
                controller = subprocess.Popen(
                    [sys.executable, "-m", "slotune.cli", "control", "--engine-url", handle.url, "--admin-token",
                     engine.token, "--policy", str(out / "policy.yaml"), "--log", str(out / "controller.jsonl")],
                    cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        phases = []
        for i, (mix, rate) in enumerate(((args.mix, args.rate), (args.mix2 or args.mix, rate_two(args)))):
            started = time.time()
            summary = run_phase(handle.url, out / f"phase{i + 1}", mix, rate, args.phase_seconds, args.seed + i, slo)
            phases.append({"rate": rate, "mix": mix, "started": started, "summary": {
                k: summary.get(k) for k in ("requests", "completed", "failed", "unfinished", "lost_requests",
                                            "attainment", "goodput_rps", "tbt_p99", "ttft_p99")}})
        final = handle.get_config()
    finally:
        if controller is not None:
            controller.terminate()
            controller.wait(30)
        engine.stop()
    return {"arm": arm.name, "start_knobs": arm.knobs, "final_knobs": final, "phases": phases,
            **({"decisions": decisions(out / "controller.jsonl")} if arm.controlled else {})}


def policy_for(slo: SLO) -> dict[str, Any]:
    return {**POLICY, "slo": {"tbt_p99": f"{slo.tbt_p99}s", "ttft_p99": f"{slo.ttft_p99}s"}}


def rate_two(args: argparse.Namespace) -> float:
    return float(args.rate2) if args.rate2 else 4 * args.rate


def decisions(log: Path) -> dict[str, Any]:
    """What the controller did: its canaries, its decisions by outcome and trigger, each with its time and why."""
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    made = [r for r in records if r.get("kind") == "decision"]
    return {"canaries": sum(r.get("kind") == "canary" for r in records),
            "moves": sum(r.get("outcome") == "kept" for r in made),
            "by_outcome": {o: sum(r.get("outcome") == o for r in made) for o in sorted({r.get("outcome") for r in made})},
            "decisions": [{"time": r["time"], "outcome": r.get("outcome"), "trigger": (r.get("trigger") or {}).get("kind"),
                           "reason": r.get("reason")} for r in made]}


def attainment_series(records: list[RequestRecord], slo: SLO, t0: float, bin_s: float) -> list[dict[str, Any]]:
    bins: dict[int, list[bool]] = {}
    for r in records:
        bins.setdefault(int((r.intended_send_time - t0) // bin_s), []).append(attains(r, slo))
    out = []
    for b in sorted(bins):
        hits = bins[b]
        ci = proportion_interval(sum(hits), len(hits))
        out.append({"t": (b + 0.5) * bin_s, "attainment": ci.value, "low": ci.low, "high": ci.high, "n": len(hits)})
    return out


def phase_after_settling(records: list[RequestRecord], slo: SLO, settle: float, seconds: float) -> dict[str, Any]:
    t0 = min(r.intended_send_time for r in records)
    kept = [r for r in records if r.intended_send_time - t0 >= settle]
    ok = sum(attains(r, slo) for r in kept)
    ci = proportion_interval(ok, len(kept))
    return {"attainment": ci.as_dict(), "goodput_rps": ok / max(1e-9, seconds - settle), "requests": len(kept)}


def analyse(results: list[dict[str, Any]], out: Path, args: argparse.Namespace, slo: SLO) -> dict[str, Any]:
    for res in results:
        arm_dir = out / res["arm"]
        series, t_offset = [], 0.0
        for i, phase in enumerate(res["phases"]):
            records = read_records(str(arm_dir / f"phase{i + 1}" / "records.parquet"))
            t0 = min(r.intended_send_time for r in records)
            series += [{**p, "t": p["t"] + t_offset, "phase": i + 1}
                       for p in attainment_series(records, slo, t0, args.bin)]
            phase["after_settling"] = phase_after_settling(records, slo, args.settle, args.phase_seconds)
            t_offset += args.phase_seconds
        res["series"] = series
    verdicts: list[dict[str, Any]] = []
    if not any(r["arm"] == "controller" for r in results):
        return {"verdicts": verdicts}
    for i in range(2):
        static_best = max((r["phases"][i]["after_settling"]["goodput_rps"] for r in results
                           if r["arm"] != "controller"), default=None)
        ctl = next(r for r in results if r["arm"] == "controller")["phases"][i]["after_settling"]
        verdicts.append({"phase": i + 1, "controller_attainment": ctl["attainment"],
                         "controller_goodput_rps": ctl["goodput_rps"], "best_static_goodput_rps": static_best,
                         "goodput_ratio": ctl["goodput_rps"] / static_best if static_best else None,
                         "attainment_target_met": ctl["attainment"]["low"] is not None
                         and ctl["attainment"]["low"] >= 0.9})
    return {"verdicts": verdicts}


def plot(results: list[dict[str, Any]], out: Path, args: argparse.Namespace) -> Path | None:
    import plotly.graph_objects as go

    fig = go.Figure()
    for res in results:
        s = res["series"]
        fig.add_trace(go.Scatter(x=[p["t"] for p in s], y=[p["attainment"] for p in s], mode="lines+markers",
                                 name=res["arm"]))
    fig.add_hline(y=0.9, line_dash="dash", line_color="#d62728")
    fig.add_vline(x=args.phase_seconds, line_dash="dot", line_color="#555")
    fig.update_layout(template="plotly_white", width=1100, height=500,
                      title=f"SLO attainment over time: phase 1 {args.rate:g} req/s ({args.mix}), phase 2 "
                            f"{rate_two(args):g} req/s ({args.mix2 or args.mix})",
                      xaxis_title="seconds (intended send time)", yaxis_title="attainment", yaxis_range=[0, 1.05])
    html = out / "controller_shift.html"
    fig.write_html(str(html), include_plotlyjs=True)
    try:
        from dashboards.screenshots import full_page_screenshot, start_browser

        browser = start_browser(width=1150, height=560)
        try:
            browser.get(html.resolve().as_uri())
            time.sleep(2)
            return full_page_screenshot(browser, out / "controller_shift.png", width=1150)
        finally:
            browser.quit()
    except (FileNotFoundError, OSError, RuntimeError) as error:
        print(f"no PNG ({error}); the figure is in {html}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="build/controller-shift")
    p.add_argument("--phase-seconds", type=float, default=300.0)
    p.add_argument("--rate", type=float, default=0.4, help="phase one's rate (req/s)")
    p.add_argument("--rate2", default=None, help="phase two's rate (req/s; default: 4 x --rate), or auto: "
                   f"{SHIFT_LOAD:g} x what the phase-one config finishes of phase two's requests on this machine")
    p.add_argument("--slo-p99-tbt", type=float, default=0.25, help="the SLO's p99 TBT target, seconds")
    p.add_argument("--slo-p99-ttft", type=float, default=3.0, help="the SLO's p99 TTFT target, seconds")
    p.add_argument("--mix", default="short=16:24")
    p.add_argument("--mix2", default=None, help="phase two's mix (default: --mix), e.g. long=16:160: longer outputs "
                                                "hold each sequence longer")
    p.add_argument("--settle", type=float, default=120.0, help="seconds after each phase starts not judged")
    p.add_argument("--bin", type=float, default=20.0, help="seconds per point of the attainment curve")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="the arms to run (default: all)")
    p.add_argument("--rerun", nargs="+", choices=ARMS, default=None,
                   help="run only these arms again; the others are read from OUT/controller_shift.json")
    p.add_argument("--phase1-config", default=None, help="JSON knobs of the config tuned for phase one (default: "
                   f"{json.dumps(PHASE_ONE_CONFIG)})")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slo = SLO(tbt_p99=args.slo_p99_tbt, ttft_p99=args.slo_p99_ttft)
    phase_one = json.loads(args.phase1_config) if args.phase1_config else PHASE_ONE_CONFIG
    calibration = None
    if args.rate2 == "auto":
        calibration = calibrated_rate(args.mix2 or args.mix, phase_one)
        args.rate2 = calibration["rate2"]
        print(f"phase two at {args.rate2} req/s: {calibration}", file=sys.stderr, flush=True)
    arms = [a for a in (Arm("default", {}), Arm("phase1_tuned", phase_one), Arm("controller", phase_one, controlled=True))
            if a.name in args.arms]
    started = time.time()
    results = []
    earlier = {}
    if args.rerun:  # the other arms' results from OUT's earlier run with the same arguments
        earlier = {r["arm"]: r for r in json.loads((out / "controller_shift.json").read_text())["arms"]}
    for arm in arms:
        if arm.name in earlier and arm.name not in args.rerun:
            results.append(earlier[arm.name])
            continue
        print(f"arm {arm.name} ...", file=sys.stderr, flush=True)
        results.append(run_arm(arm, args, out / arm.name, slo))
    report = {"cpu": cpu_name(), "machine": platform.machine(), "args": vars(args), "slo": slo.as_dict(),
              "policy": policy_for(slo), "calibration": calibration, "wall_s": time.time() - started,
              "arms": results, **analyse(results, out, args, slo)}
    (out / "controller_shift.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    png = plot(results, out, args)
    for v in report["verdicts"]:
        a = v["controller_attainment"]
        static = v["best_static_goodput_rps"]
        print(f"phase {v['phase']}: controller attainment {a['value']:.1%} ({a['low']:.1%}-{a['high']:.1%}) after "
              f"{args.settle:g}s; goodput {v['controller_goodput_rps']:.3f} req/s"
              + (f" vs best static {static:.3f} (x{v['goodput_ratio']:.2f})" if static else ""))
    for res in results:
        if "decisions" in res:
            d = res["decisions"]
            print(f"controller: {d['canaries']} canaries, {d['moves']} kept; decisions {d['by_outcome']}")
    print(f"{out / 'controller_shift.json'}" + (f", {png}" if png else "") + f" ({report['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
