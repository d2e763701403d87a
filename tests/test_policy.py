"""Policies: the shipped default loads (from the installed package too), and bad policies fail naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from policies import PolicyError, default_policy_path, load_policy, parse_policy

BASE = {"slo": {"tbt_p99": "50ms"}, "search_space": {"max_num_seqs": {"low": 1, "high": 16, "log": True}}}


def with_(**changes: object) -> dict:
    d = {**BASE, **changes}
    return d


def test_default_policy_loads_and_is_attainable_shaped() -> None:
    p = load_policy()
    assert p.slo.tbt_p99 == pytest.approx(0.050)
    assert {k.name for k in p.search_space} >= {"max_num_seqs", "max_num_batched_tokens", "chunk_size", "block_size"}
    assert p.knob("max_num_seqs").low == 1  # a batch of one must be reachable: the 50 ms SLO needs it on a CPU
    assert [str(c) for c in p.constraints] == ["chunk_size <= max_num_batched_tokens",
                                               "max_num_seqs <= max_num_batched_tokens"]
    assert p.rate is None and p.sampler == "tpe" and p.objective == "capacity"
    assert p.slo.ttft_p99 == pytest.approx(2.0) and p.workload.output_scale == 0.25
    assert p.measurement.level == 0.95 and p.measurement.min_gaps == 400 and p.measurement.cap == 45.0
    assert p.measurement.block == 3.0  # an attainment's blocks: longer than a queue episode near the knee
    assert p.capacity.resolution == 0.15 and p.verdict.max_rounds == 4 and p.verdict.budget == 660.0
    assert p.time_budget == 1320.0


def test_default_policy_is_package_data() -> None:
    # found through importlib.resources (what an installed package offers), from any working directory
    out = subprocess.run([sys.executable, "-c", "from policies import default_policy_path as d; print(d())"],
                         capture_output=True, text=True, cwd="/", check=True).stdout.strip()
    assert Path(out).is_file() and Path(out) == default_policy_path()
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert 'policies = ["*.yaml"]' in pyproject


@pytest.mark.parametrize("data, field, words", [
    ({"search_space": BASE["search_space"]}, "slo.tbt_p99", "required"),
    (with_(slo={"tbt_p99": "fast"}), "slo.tbt_p99", "not a duration"),
    (with_(slo={"tbt_p99": "50ms", "ttft": "2s"}), "slo.ttft", "unknown field"),
    (with_(search_space={}), "search_space", "at least one"),
    (with_(search_space={"max_num_sequences": [1, 2]}), "search_space.max_num_sequences", "unknown knob"),
    (with_(search_space={"max_num_seqs": {"low": 8, "high": 2}}), "search_space.max_num_seqs.low", "<= high"),
    (with_(search_space={"max_num_seqs": {"low": 0, "high": 2}}), "search_space.max_num_seqs.low", ">= 1"),
    (with_(search_space={"max_num_seqs": {"high": 2}}), "search_space.max_num_seqs.low", "required"),
    (with_(search_space={"block_size": {"choices": []}}), "search_space.block_size.choices", "non-empty"),
    (with_(search_space={"block_size": {"choices": [16, "big"]}}), "search_space.block_size.choices[1]", "integer"),
    (with_(search_space={"preemption_mode": {"low": 1, "high": 2}}), "search_space.preemption_mode", "choices"),
    (with_(constraints=["chunk_size << max_num_seqs"]), "constraints[0]", "cannot parse"),
    (with_(constraints=["chunk <= max_num_seqs"]), "constraints[0]", "unknown knob"),
    (with_(sampler="cmaes"), "sampler", "tpe"),
    (with_(objective="latency"), "objective", "goodput"),
    (with_(trials=0), "trials", ">= 1"),
    (with_(trial_duration="soon"), "trial_duration", "not a duration"),
    (with_(rate="fast"), "rate", "auto"),
    (with_(workload={"name": "mixed", "length_scale": -1}), "workload.length_scale", "> 0"),
    (with_(fixed={"max_num_seqs": 4}), "fixed.max_num_seqs", "also in search_space"),
    (with_(pruning={"violation_share": 2}), "pruning.violation_share", "<= 1.0"),
    (with_(sampler="grid", search_space={"prefill_token_ratio": {"low": 0.1, "high": 1.0}}),
     "search_space.prefill_token_ratio", "grid sampler"),
    (with_(bogus=1), "bogus", "unknown field"),
    (with_(measurement={"level": 1.0}), "measurement.level", "< 1"),
    (with_(measurement={"level": 0.4}), "measurement.level", "> 0.5"),
    (with_(measurement={"cap": "5s"}), "measurement.cap", ">= trial_duration"),
    (with_(measurement={"min_gaps": 0}), "measurement.min_gaps", ">= 1"),
    (with_(measurement={"gaps": 3}), "measurement.gaps", "unknown field"),
    (with_(capacity={"resolution": 0}), "capacity.resolution", "> 0"),
    (with_(capacity={"max_probes": 0}), "capacity.max_probes", ">= 1"),
    (with_(capacity={"start_rate": -1}), "capacity.start_rate", "> 0"),
    (with_(verdict={"max_rounds": 1}), "verdict.max_rounds", ">= 2"),
    (with_(verdict={"budget": "never"}), "verdict.budget", "not a duration"),
    (with_(verdict={"candidates": 0}), "verdict.candidates", ">= 1"),
    (with_(workload={"name": "mixed", "output_scale": 0}), "workload.output_scale", "> 0"),
    (with_(time_budget="4m"), "time_budget", "more than verdict.budget"),
])
def test_bad_policy_names_the_field(data: dict, field: str, words: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(data)
    assert info.value.field == field
    assert words in str(info.value)


def test_policy_file_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text(yaml.safe_dump(with_(sampler="cmaes")))
    with pytest.raises(PolicyError, match=r"p\.yaml: sampler: must be one of"):
        load_policy(bad)
    bad.write_text("slo: [unclosed")
    with pytest.raises(PolicyError, match="not valid YAML"):
        load_policy(bad)
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "missing.yaml")


def test_constraints_repair_the_searched_side() -> None:
    p = parse_policy(with_(search_space={"max_num_seqs": [1, 64], "chunk_size": [16, 512],
                                         "max_num_batched_tokens": [32, 256]},
                           constraints=["chunk_size <= max_num_batched_tokens",
                                        "max_num_seqs <= max_num_batched_tokens", "max_num_seqs <= 48"]))
    knobs = p.repair({"max_num_seqs": 64, "chunk_size": 512, "max_num_batched_tokens": 32})
    assert knobs == {"max_num_seqs": 32, "chunk_size": 32, "max_num_batched_tokens": 32}
    assert p.repair({"max_num_seqs": 64, "chunk_size": 16, "max_num_batched_tokens": 256})["max_num_seqs"] == 48
    ok = {"max_num_seqs": 1, "chunk_size": 16, "max_num_batched_tokens": 256}
    assert p.repair(ok) == ok
    assert all((c.value(knobs) or 0) <= 0 for c in p.constraints)


def test_grid_values() -> None:
    p = parse_policy(with_(sampler="grid", search_space={"max_num_seqs": {"low": 1, "high": 12, "log": True},
                                                         "chunk_size": {"low": 16, "high": 64, "step": 16},
                                                         "block_size": [8, 16]}))
    assert p.knob("max_num_seqs").grid_values() == [1, 2, 4, 8, 12]
    assert p.knob("chunk_size").grid_values() == [16, 32, 48, 64]
    assert p.knob("block_size").grid_values() == [8, 16]


def shipped_fields() -> list[tuple[str, ...]]:
    """Every field of the shipped default.yaml, a section's fields one by one (the search space, the fixed knobs and
    the constraints are each one field: a policy gives them whole)."""
    shipped = yaml.safe_load(default_policy_path().read_text())
    fields: list[tuple[str, ...]] = []
    for key, value in shipped.items():
        if isinstance(value, dict) and key not in {"search_space", "fixed"}:
            fields += [(key, inner) for inner in value]
        else:
            fields.append((key,))
    return fields


@pytest.mark.parametrize("path", [p for p in shipped_fields() if p != ("slo", "tbt_p99")], ids=".".join)
def test_a_policy_that_leaves_out_a_field_gets_the_shipped_default_for_it(path: tuple[str, ...]) -> None:
    shipped = yaml.safe_load(default_policy_path().read_text())
    data = yaml.safe_load(default_policy_path().read_text())
    if len(path) == 1:
        del data[path[0]]
    else:
        del data[path[0]][path[1]]
    assert parse_policy(data) == parse_policy(shipped)


def test_every_shipped_field_is_seen_by_the_field_by_field_test() -> None:
    # the walk finds the sections' fields: a policy that changes one gets a different policy
    fields = shipped_fields()
    assert ("objective",) in fields and ("measurement", "block") in fields and ("canary", "max_window") in fields
    assert parse_policy({**BASE, "objective": "goodput"}).objective == "goodput"
    assert load_policy().objective == "capacity" and parse_policy(BASE).objective == "capacity"
    assert parse_policy(BASE).trials == load_policy().trials and parse_policy(BASE).time_budget == 1320.0
    assert parse_policy(with_(measurement={"level": 0.9})).measurement.cap == load_policy().measurement.cap


def test_a_trace_workload_does_not_inherit_the_shipped_workloads_scales() -> None:
    # the shipped output scale (0.25) is for the mixed workload's lengths: a trace scaled 1/16 scales its outputs
    # 1/16 too unless it says otherwise, as tune's --workload does
    trace = parse_policy(with_(workload={"name": "conv.csv", "length_scale": 0.0625, "max_context": 2048})).workload
    assert (trace.length_scale, trace.output_scale, trace.max_context, trace.mix) == (0.0625, None, 2048, None)
    assert parse_policy(with_(workload={"name": "conv.csv"})).workload.length_scale == 1.0  # the trace as it is
    own = parse_policy(with_(workload={"name": "conv.csv", "output_scale": 0.5})).workload
    assert own.output_scale == 0.5
    mixed = parse_policy(with_(workload={"length_scale": 0.25})).workload  # the shipped workload, field by field
    assert (mixed.name, mixed.length_scale, mixed.output_scale) == ("mixed", 0.25, 0.25)


def test_the_defaults_code_builds_with_are_the_shipped_ones() -> None:
    # the controller's sections, the pruning rule and a trial runner's busy-machine bound are also built in code
    # (tests, benchmarks, the controller's own defaults)
    from policies.control import ControlSpec
    from policies.policy import PruningSpec
    from tuner.trials.host_load import BUSY_CORES

    assert ControlSpec() == load_policy().control and PruningSpec() == load_policy().pruning
    assert BUSY_CORES == load_policy().measurement.busy
