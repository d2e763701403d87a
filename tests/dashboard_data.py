"""Hand-made result folders and studies in the shared formats (sweep.json slotune-sweep/1, trial
folders slotune-trial/1, Optuna user attrs), for the dashboard tests. The numbers are chosen so the answers are
known: see KNEE_* and PARETO_*."""

from __future__ import annotations

import datetime as dt
import json
import math
import random
from pathlib import Path
from typing import Any

TBT_TARGET = 0.050
SLO = {"tbt_p99": TBT_TARGET, "ttft_p99": 2.0, "e2e_p99": None}

# max_num_seqs 4..64: throughput grows by 90 %, 50 %, 25 %, then 4 % -> the gain knee is at 32;
# p99 TBT crosses 50 ms at 64, so 32 is also the last point within the SLO: the knee is 32, reason "slo".
SWEEP_VALUES = [4, 8, 16, 32, 64]
SWEEP_TOKENS = [100.0, 190.0, 285.0, 356.0, 370.0]
SWEEP_TBT = [0.020, 0.024, 0.031, 0.042, 0.066]
SWEEP_TTFT = [0.30, 0.35, 0.45, 0.60, 1.10]
SWEEP_GOODPUT = [1.0, 1.9, 2.8, 3.5, 1.2]
KNEE_VALUE = 32


def step_records(n: int, start: float, seed: int = 0) -> list[dict[str, Any]]:
    """Step records with the fields of engine/step_record.py StepRecord.to_dict()."""
    rnd = random.Random(seed)
    out = []
    t = start
    for i in range(n):
        prefill = rnd.choice([0, 0, 0, 64, 128])
        decode = rnd.randint(4, 16)
        total = 0.008 + 0.0001 * (prefill + decode) + rnd.random() * 0.002
        used = min(200, 20 + i // 2)
        out.append({"step": i, "start_time": t, "schedule_s": 0.0002, "forward_s": total * 0.9, "sample_s": 0.0003,
                    "total_s": total, "num_prefill_seqs": 1 if prefill else 0, "num_prefill_tokens": prefill,
                    "num_decode_tokens": decode, "num_running": decode, "num_waiting": rnd.randint(0, 5),
                    "num_preempted": 0, "kv_blocks_used": used, "kv_blocks_free": 256 - used,
                    "num_preemptions": 1 if i % 97 == 50 else 0, "prefix_cache_hit_tokens": 0,
                    "config_generation": 1, "context_tokens": 1000, "num_swapped_blocks": 0})
        t += total
    return out


def request_records(n: int, start: float, tbt: float, ttft: float, seed: int = 0) -> list[Any]:
    from loadtest.records import RequestRecord

    rnd = random.Random(seed)
    records = []
    for i in range(n):
        sent = start + i * 0.25
        first = sent + ttft * (0.5 + rnd.random())
        times = [first]
        for _ in range(rnd.randint(8, 40)):
            times.append(times[-1] + tbt * (0.4 + 0.6 * rnd.random()))
        records.append(RequestRecord(index=i, id=f"r{i}", kind="short", scheduled_at=i * 0.25,
                                     intended_send_time=sent, actual_send_time=sent + 0.0005, prompt_tokens=64,
                                     max_tokens=len(times), output_tokens=len(times), ttft=first - sent,
                                     token_times=times, finish_time=times[-1], status="ok", http_status=200))
    return records


def write_trial(folder: Path, knobs: dict[str, Any], summary: dict[str, Any], feasible: bool = True,
                simulated: bool = False, n_requests: int = 20, n_steps: int = 150, seed: int = 0) -> Path:
    from loadtest.records import write_records

    folder.mkdir(parents=True, exist_ok=True)
    start = 1_780_000_000.0
    write_records(str(folder / "records.parquet"),
                  request_records(n_requests, start, summary.get("tbt_p99") or 0.03, summary.get("ttft_p99") or 0.5,
                                  seed))
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in step_records(n_steps, start, seed)))
    stats = {"steps": float(n_steps), "mean_batch_seqs": 10.0, "preemptions": 1.0}
    (folder / "trial.json").write_text(json.dumps({
        "format": "slotune-trial/1", "knobs": knobs, "step_stats": stats, "feasible": feasible,
        "reason": None if feasible else "p99 TBT above the SLO", "workload": "mixed", "rate": 4.0, "slo": SLO,
        "started_at": dt.datetime.fromtimestamp(start, dt.timezone.utc).isoformat(), "simulated": simulated}))
    return folder


def summary_of(tokens: float, goodput: float, tbt: float, ttft: float) -> dict[str, Any]:
    return {"output_tokens_per_s": tokens, "goodput_rps": goodput, "tbt_p99": tbt, "ttft_p99": ttft,
            "throughput_rps": goodput * 1.1, "attainment": 0.95, "requests": 20}


def write_sweep(folder: Path, simulated: bool = False, values: list[int] | None = None) -> Path:
    """A max_num_seqs sweep folder with one trial folder per point (the numbers above)."""
    values = values or SWEEP_VALUES
    points = []
    for i, v in enumerate(values):
        s = summary_of(SWEEP_TOKENS[i], SWEEP_GOODPUT[i], SWEEP_TBT[i], SWEEP_TTFT[i])
        feasible = SWEEP_TBT[i] <= TBT_TARGET
        write_trial(folder / f"max_num_seqs={v}", {"max_num_seqs": v, "max_num_batched_tokens": 256}, s, feasible,
                    simulated, seed=i)
        points.append({"value": v, "dir": f"max_num_seqs={v}", "summary": s, "step_stats": {"steps": 150.0},
                       "feasible": feasible, "reason": None if feasible else "p99 TBT above the SLO"})
    (folder / "sweep.json").write_text(json.dumps({
        "format": "slotune-sweep/1", "knob": "max_num_seqs", "values": values,
        "fixed": {"max_num_batched_tokens": 256}, "workload": "mixed", "rate": 4.0, "slo": SLO,
        "simulated": simulated, "points": points}))
    return folder


# A study: goodput depends strongly on max_num_seqs and hardly on chunk_size; trials with p99 TBT > 50 ms are
# infeasible (constraint > 0).
def tbt_of(seqs: int) -> float:
    return 0.015 + 0.0009 * seqs


def write_study(storage_url: str, name: str = "tune", n_trials: int = 12, trial_root: Path | None = None,
                feasible_attr: bool = True) -> None:
    """`feasible_attr=False` leaves out the "feasible" user attr: feasibility then comes from the constraints."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from tuner.search.study import open_storage

    study = optuna.create_study(study_name=name, storage=open_storage(storage_url), direction="maximize",
                                sampler=optuna.samplers.RandomSampler(seed=3))
    study.set_user_attr("slo", SLO)
    study.set_user_attr("workload", "mixed")
    study.set_user_attr("objective", "goodput")
    study.set_user_attr("rate", 4.0)
    for i in range(n_trials):
        trial = study.ask()
        seqs = trial.suggest_int("max_num_seqs", 2, 64, log=True)
        chunk = trial.suggest_int("chunk_size", 16, 256, log=True)
        tbt = tbt_of(seqs)
        tokens = 40.0 * math.sqrt(seqs) + 0.01 * chunk
        goodput = tokens / 60.0 * (1.0 if tbt <= TBT_TARGET else 0.3)
        summary = summary_of(tokens, goodput, tbt, 0.4)
        feasible = tbt <= TBT_TARGET
        trial_dir = None
        if trial_root is not None:
            trial_dir = str(write_trial(trial_root / f"trial-{i:04d}", {"max_num_seqs": seqs, "chunk_size": chunk},
                                        summary, feasible, n_steps=60, n_requests=10, seed=i))
        for key, value in {"knobs": {"max_num_seqs": seqs, "chunk_size": chunk}, "summary": summary,
                           "step_stats": {"steps": 60.0}, "feasible": feasible,
                           "reason": None if feasible else "p99 TBT above the SLO", "trial_dir": trial_dir,
                           "simulated": False}.items():
            if key != "feasible" or feasible_attr:
                trial.set_user_attr(key, value)
        trial.set_constraint("tbt_p99", tbt - TBT_TARGET)  # Optuna 5's way; <= 0 is satisfied
        study.tell(trial, goodput)


# A capacity study as `tune` writes it: the default config (no params: its knobs are the engine's base config), a
# trial whose sampled chunk_size the constraints repaired (64 -> 128), and an infeasible one; each trial's value is
# its searched capacity, the bracket's low end. No rate: every trial searches its own.
CAPACITY_BASE = {"max_num_seqs": 256, "chunk_size": 512, "block_size": 16}
CAPACITY_TRIALS: list[tuple[dict[str, Any], dict[str, Any], list[float | None]]] = [
    ({}, CAPACITY_BASE, [1.6, 2.0]),
    ({"max_num_seqs": 8, "chunk_size": 64}, {"max_num_seqs": 8, "chunk_size": 128, "block_size": 16}, [4.2, 4.8]),
    ({"max_num_seqs": 64, "chunk_size": 256}, {"max_num_seqs": 64, "chunk_size": 256, "block_size": 16}, [0.0, 0.5]),
]


def write_capacity_study(storage_url: str, name: str = "capacity") -> None:
    import optuna

    from tuner.search.study import open_storage
    from tuner.search.trial_record import default_attrs, measured_attrs, stamp, study_attrs

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=open_storage(storage_url), direction="maximize")
    stamp(study, study_attrs(slo=SLO, workload={"name": "mixed"}, objective="capacity", model=None, policy={}))
    for params, knobs, (low, high) in CAPACITY_TRIALS:
        study.enqueue_trial(params, user_attrs=default_attrs() if not params else None)
        trial = study.ask()
        for knob in params:
            trial.suggest_int(knob, 2, 512, log=True)  # the enqueued value
        assert low is not None and trial.params == params
        feasible = low > 0
        capacity = {"req_per_s": low, "bracket": [low, high], "describe": f"searched {low:g} req/s ({low:g}-{high:g})",
                    "at_capacity": "attainment 94% (88-98%) met" if feasible else None}
        stamp(trial, measured_attrs(
            knobs=knobs, summary=summary_of(60.0 * low, low, 0.03, 0.4) if feasible else {}, step_stats={},
            feasible=feasible, reason=None if feasible else f"no rate read served down to {high:g} req/s",
            trial_dir="", steps_dir="", simulated=True, pruned=False, rate=low if feasible else None,
            constraints=[-0.01 if feasible else 1e-3], capacity=capacity))
        study.tell(trial, low)
