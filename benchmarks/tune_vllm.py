"""`tune --engine vllm` on vLLM's CPU build: the README's vLLM command, how long it took and how much of it went to
starting servers, and an independent check of its claims on vLLM on an arrival seed the run never used.

    python benchmarks/tune_vllm.py --out docs/benchmarks/tune-vllm.json
    python benchmarks/tune_vllm.py --out docs/benchmarks/tune-vllm-300ms.json --slo 300ms 5s

Steps: (1) `tune --engine vllm --policy policies/vllm-cpu.yaml --seed VLLM_SEED` in a fresh folder beside --out
(`--slo` replaces the README's 50 ms where this CPU's floor is above it); (2) when the run named a config shown to
serve some rate, that config and vLLM's defaults each on a fresh vLLM server at that rate, one sustained window of
CHECK_S seconds on INDEPENDENT_SEED, judged as tune judges a measurement. vLLM's environment: docs/engines.md.

The seeds are fixed here, before the runs; every run made is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from engine.cpu_info import cpu_name  # noqa: E402
from policies import WorkloadSpec, load_policy  # noqa: E402
from slotune.slo import SLO  # noqa: E402
from tune_evidence import INDEPENDENT_SEED, check_record, run_tune, shown  # noqa: E402
from tuner.commands.engines import SERVED_NAME, default_model_dir, default_vllm_python  # noqa: E402
from tuner.measure.capacity import measurement_spec  # noqa: E402
from tuner.measure.measurement import measure  # noqa: E402
from tuner.trials.engine_kinds import vllm_kind  # noqa: E402
from tuner.trials.restarted_engine import RestartedEngine  # noqa: E402
from tuner.trials.trial_runner import TrialRunner  # noqa: E402

VLLM_SEED = 61  # the run's --seed (fixed before the run; no other run used it)
CHECK_S = 120.0  # seconds of one independent check's sustained window (each check also costs a vLLM start)
POLICY = REPO / "policies" / "vllm-cpu.yaml"
# vLLM's CPU build sizes its KV cache at ~90 % of the machine's memory by default (20.6 of 23.5 GiB here), and a
# start fails when anything else holds memory; 4 GiB holds ~180,000 tokens of the default model, far more than any
# config here keeps. A memory budget, not a batching knob: the knobs stay at vLLM's defaults.
KV_CACHE_GIB = "4"


def vllm_check(knobs: dict[str, Any], rate: float, slo: dict[str, Any], workload: dict[str, Any],
               folder: Path) -> dict[str, Any]:
    """A fresh vLLM server with ``knobs`` at ``rate``: one sustained window of CHECK_S on the independent seed."""
    policy = load_policy(str(POLICY))
    kind = vllm_kind(default_vllm_python(), default_model_dir(), SERVED_NAME, [])
    with RestartedEngine(kind, folder / "servers") as engine:
        runner = TrialRunner(engine, workload=WorkloadSpec(**workload), rate=rate, duration=CHECK_S,
                             warmup=policy.warmup, slo=SLO.from_dict(slo), seed=INDEPENDENT_SEED,
                             server_warmup=policy.server_warmup)
        spec = replace(measurement_spec(policy), sustained_s=CHECK_S)
        m = measure(runner, knobs, rate, folder, INDEPENDENT_SEED // 1000, spec)
        started = engine.restart_seconds()
    return check_record(m) | {"knobs": knobs, "start_seconds": started}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slo", nargs=2, metavar=("TBT", "TTFT"), help="targets instead of the README's 50ms / 2s")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)  # tune's vLLM servers inherit it
    out = Path(a.out).resolve()
    folder = out.with_suffix("")
    extra = ["--engine", "vllm", "--policy", str(POLICY), "--seed", str(VLLM_SEED)]
    if a.slo:
        extra += ["--slo-p99-tbt", a.slo[0], "--slo-p99-ttft", a.slo[1]]
    run = run_tune(folder, extra)
    log = (folder / "tune.log").read_text()
    starts = re.search(r"done in ([^,]+), (.+) of it starting (\d+) servers \((\d+) did not come up\)", log)
    ups = [float(x) for x in re.findall(r"up at http://\S+ in (\d+)s", log)]
    result: dict[str, Any] = {"run": run, "seed": VLLM_SEED, "command": ["tune", "--slo-p99-tbt", "50ms", *extra],
                              "done_line": starts.group(0) if starts else None, "first_start_s": ups[0] if ups else None,
                              "floor_line": next((line for line in log.splitlines() if ": floor:" in line), None)}
    tuned_low, _ = shown(run.get("tuned"))
    if tuned_low and run.get("default"):
        result["independent_checks"] = {
            "tuned": vllm_check(run["tuned"]["knobs"], tuned_low, run["slo"], run["workload"], folder / "check-tuned"),
            "default": vllm_check(run["default"]["knobs"], tuned_low, run["slo"], run["workload"],
                                  folder / "check-default"),
            "seed": INDEPENDENT_SEED, "window_s": CHECK_S}
    result.update(cpu=cpu_name(), cores=os.cpu_count(), date=time.strftime("%Y-%m-%dT%H:%M:%S"),
                  vllm_cpu_kvcache_space_gib=os.environ["VLLM_CPU_KVCACHE_SPACE"])
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"rc {run.get('rc')} in {run.get('seconds') or 0:.0f}s: {run.get('last_line')}")
    print(result["floor_line"] or "(no floor line)")
    print(result["done_line"] or "(no done line)")
    for name, c in (result.get("independent_checks") or {}).items():
        if isinstance(c, dict):
            print(f"check {name} at {c['rate']:.3g} req/s: {c['describe']}")
    print(f"wrote {out} ({result['cpu']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
