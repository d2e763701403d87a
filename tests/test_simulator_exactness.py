"""The simulator reproduces the engine's decisions step for step: the real engine (default model, offline) serves
requests that arrive at given times on a clock advanced by its own measured step durations; the simulator gets the
same arrivals and replays those durations, and every step's batch composition must be identical."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from engine.sampling_params import SamplingParams
from loadtest.tokens import PromptBuilder, TokenSpace
from loadtest.workloads import MixedWorkload, PrefixWorkload, RequestSpec, parse_mix
from tuner.simulation.simulator import ReplayStepTimes, SimOptions, simulate

COMPARED = ("num_prefill_seqs", "num_prefill_tokens", "num_decode_tokens", "num_running", "num_waiting",
            "num_preempted", "kv_blocks_used", "kv_blocks_free", "num_preemptions", "prefix_cache_hit_tokens",
            "context_tokens", "num_swapped_blocks")


@pytest.fixture(scope="module")
def engine():
    from engine.llm_engine import LLMEngine

    eng = LLMEngine()
    yield eng
    eng.close()


def run_engine(engine: Any, specs: list[RequestSpec]) -> tuple[list[dict[str, Any]], list[float], dict[int, list[float]]]:
    """The engine loop's order (add what has arrived, then step) on a virtual clock that advances by each step's
    measured duration. Returns the step records, their durations and every request's token times (virtual)."""
    builder = PromptBuilder(TokenSpace())
    pending = sorted(specs, key=lambda s: s.at)
    first = engine.step_records()[-1].step if engine.step_records() else -1
    token_times: dict[int, list[float]] = {s.index: [] for s in specs}
    t = 0.0
    j = 0
    while j < len(pending) or engine.has_unfinished_requests():
        while j < len(pending) and pending[j].at <= t:
            s = pending[j]
            engine.add_request(builder.tokens(s.segments, s.prompt_len),
                               SamplingParams(max_tokens=s.output_len, ignore_eos=True, temperature=0.0),
                               request_id=str(s.index))
            j += 1
        if not engine.has_unfinished_requests():
            t = pending[j].at
            continue
        before = engine.step_records()[-1].step if engine.step_records() else -1
        outputs = engine.step()
        new = engine.step_records(before)
        assert len(new) == 1, "every step of these cases schedules something"
        t += new[0].total_s
        for out in outputs:
            token_times[int(out.request_id)] += [t] * len(out.new_token_ids)
    records = [r.to_dict() for r in engine.step_records(first)]
    return records, [r["total_s"] for r in records], token_times


def specs_at(workload: Any, times: list[float]) -> list[RequestSpec]:
    from dataclasses import replace

    return [replace(spec, at=t) for spec, t in zip(itertools.islice(workload.specs(), len(times)), times)]


CASES = {
    # chunked prefill sharing the budget with decodes, a queue behind max_num_seqs
    "chunked": ({"max_num_seqs": 4, "max_num_batched_tokens": 48, "chunk_size": 24, "block_size": 16,
                 "num_kv_blocks": 300, "max_model_len": 256, "enable_prefix_caching": True},
                MixedWorkload(parse_mix("a=10-70:3-9", "1"), seed=1), [0.0, 0.0, 0.05, 0.1, 0.3, 0.3]),
    # a pool too small for the batch: recompute preemptions (and re-admission that hits its own cached blocks)
    "preempting": ({"max_num_seqs": 6, "max_num_batched_tokens": 64, "block_size": 8, "num_kv_blocks": 12,
                    "max_model_len": 96, "enable_prefix_caching": True},
                   MixedWorkload(parse_mix("a=20-32:10-14", "1"), seed=2), [0.0, 0.0, 0.0, 0.02, 0.04]),
    # prefix sharing: two system prompts, their blocks reused across requests
    "prefix": ({"max_num_seqs": 4, "max_num_batched_tokens": 64, "chunk_size": 32, "block_size": 8,
                "num_kv_blocks": 301, "max_model_len": 256, "enable_prefix_caching": True},
               PrefixWorkload(groups=2, prefix_len="40", suffix_len="3-9", output_len="3-6", seed=3),
               [0.0, 0.2, 0.4, 0.4, 0.6, 0.9, 1.0, 1.5]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_arrivals_and_step_times_give_the_engines_batches(engine: Any, case: str) -> None:
    knobs, workload, times = CASES[case]
    engine.update_config(**knobs)  # a new KV layout: the engine starts from an empty pool, like the simulator
    specs = specs_at(workload, times)
    engine_steps, durations, token_times = run_engine(engine, specs)

    result = simulate(specs, engine.config, ReplayStepTimes(durations), limits=engine.limits,
                      options=SimOptions(drain_timeout=1e9))
    sim_steps = result.step_dicts()
    assert len(sim_steps) == len(engine_steps)
    for n, (e, s) in enumerate(zip(engine_steps, sim_steps)):
        assert {k: s[k] for k in COMPARED} == {k: e[k] for k in COMPARED}, f"step {n} differs"
    assert all(r.status == "ok" and r.output_tokens == r.max_tokens for r in result.records)
    if case == "preempting":
        assert sum(e["num_preemptions"] for e in engine_steps) > 0
    if case == "prefix":
        assert sum(e["prefix_cache_hit_tokens"] for e in engine_steps) > 0
    # Every token reaches the client when the engine's step that made it ended.
    for r in result.records:
        assert r.token_times == pytest.approx([result.t0 + x for x in token_times[r.index]], abs=1e-6)
