"""Validation of the engine's knobs (torch-free): a bad value gets an error that names the knob, the value and the
allowed range; a config is accepted exactly when every constraint holds; an update is all-or-nothing."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import ConfigError, EngineConfig, ModelLimits

LIMITS = ModelLimits(max_context_len=2048, kv_bytes_per_token=1024)
SMALL = dict(num_kv_blocks=200, max_model_len=1024)  # a pool that holds one sequence of max_model_len at bs 16


def examples(n: int, **more: Any) -> settings:
    """Hypothesis settings for these tests: n examples, no deadline and no speed health check (the machines that
    run them are shared and busy)."""
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow], **more)


@pytest.mark.parametrize(("knob", "value", "allowed"), [
    ("max_num_seqs", 0, ">= 1"),
    ("max_num_seqs", -3, ">= 1"),
    ("max_num_seqs", 2.5, "integer"),
    ("max_num_batched_tokens", 0, ">= 1"),
    ("chunk_size", 0, ">= 1"),
    ("chunk_size", 513, "max_num_batched_tokens (512)"),
    ("prefill_token_ratio", 0.0, "(0, 1]"),
    ("prefill_token_ratio", 1.5, "(0, 1]"),
    ("prefill_token_ratio", True, "number"),
    ("block_size", 0, "1..256"),
    ("block_size", 257, "1..256"),
    ("block_size", True, "1..256"),
    ("max_model_len", 1, "2..2048"),
    ("max_model_len", 4096, "2..2048"),
    ("num_kv_blocks", 63, ">= 64"),  # 1024 tokens of max_model_len at block size 16
    ("kv_cache_bytes", 0, ">= 1"),
    ("swap_space_bytes", -1, ">= 0"),
    ("preemption_mode", "drop", "'recompute' or 'swap'"),
    ("scheduling_policy", "lifo", "'fcfs' or 'priority'"),
    ("enable_prefix_caching", "yes", "true or false"),
    ("kernel_backend", "cuda", "'auto', 'torch', 'cpp', 'triton'"),
])
def test_bad_value_names_knob_value_and_range(knob: str, value: Any, allowed: str) -> None:
    base = EngineConfig.create(LIMITS, **SMALL)
    for attempt in (lambda: EngineConfig.create(LIMITS, **{**SMALL, knob: value}),
                    lambda: base.updated(LIMITS, **{knob: value})):
        with pytest.raises(ConfigError) as error:
            attempt()
        assert error.value.knob == knob and error.value.value == value
        message = str(error.value)
        assert knob in message and repr(value) in message and allowed in message
    assert base == EngineConfig.create(LIMITS, **SMALL) and base.generation == 0


@pytest.mark.parametrize(("start", "change", "knob"), [
    ({"max_num_seqs": 8}, {"max_num_batched_tokens": 4}, "max_num_batched_tokens"),  # budget < max_num_seqs
    ({"max_num_batched_tokens": 16, "max_num_seqs": 8}, {"max_num_seqs": 32}, "max_num_seqs"),
    ({"chunk_size": 256}, {"max_num_batched_tokens": 128}, "max_num_batched_tokens"),  # chunk_size > budget
    ({}, {"chunk_size": 1024}, "chunk_size"),
    ({"num_kv_blocks": 64}, {"block_size": 8}, "block_size"),  # the pool no longer holds max_model_len
    ({"num_kv_blocks": 64}, {"max_model_len": 2048}, "max_model_len"),
])
def test_conflicting_update_names_the_knob_just_set(start: dict[str, Any], change: dict[str, Any],
                                                    knob: str) -> None:
    config = EngineConfig.create(LIMITS, **{**SMALL, **start})
    with pytest.raises(ConfigError) as error:
        config.updated(LIMITS, **change)
    assert error.value.knob == knob and knob in str(error.value)


def test_kv_pool_too_small_for_one_sequence_of_the_context() -> None:
    """Without max_model_len the pool must hold the model's whole context (2048 tokens = 2 MiB here)."""
    with pytest.raises(ConfigError) as error:
        EngineConfig.create(LIMITS, kv_cache_bytes=(2 << 20) - 1)
    assert error.value.knob == "kv_cache_bytes" and str(2 << 20) in str(error.value)
    assert EngineConfig.create(LIMITS, kv_cache_bytes=2 << 20).resolved_num_kv_blocks(LIMITS) == 128


def test_unknown_knob_is_rejected_by_name() -> None:
    with pytest.raises(ConfigError, match="max_num_seq.*unknown knob"):
        EngineConfig.create(LIMITS, max_num_seq=4)
    with pytest.raises(ConfigError, match="unknown knob"):
        EngineConfig.create(LIMITS, **SMALL).updated(LIMITS, generation=7)


# Accepted exactly when valid ----------------------------------------------------------------------------------

KNOB_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "max_num_seqs": st.integers(-1, 40) | st.sampled_from([True, 2.0]),
    "max_num_batched_tokens": st.integers(-1, 64),
    "chunk_size": st.none() | st.integers(-1, 70),
    "prefill_token_ratio": st.sampled_from([0.0, 0.01, 0.5, 1, 1.0, 1.01, -0.5, False]),
    "block_size": st.integers(-1, 300),
    "num_kv_blocks": st.none() | st.integers(-1, 300),
    "kv_cache_bytes": st.integers(0, 1 << 20),
    "max_model_len": st.none() | st.integers(0, 2100),
    "preemption_mode": st.sampled_from(["recompute", "swap", "Swap"]),
    "swap_space_bytes": st.integers(-1, 1 << 20),
    "enable_prefix_caching": st.sampled_from([True, False, 1, None]),
    "scheduling_policy": st.sampled_from(["fcfs", "priority", "random"]),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def violations(k: dict[str, Any]) -> set[str]:
    """The knobs taking part in a broken constraint (an independent statement of the documented rules)."""
    bad: set[str] = set()
    for knob in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes"):
        if not _is_int(k[knob]) or k[knob] < 1:
            bad.add(knob)
    if not _is_int(k["swap_space_bytes"]) or k["swap_space_bytes"] < 0:
        bad.add("swap_space_bytes")
    if not bad & {"max_num_seqs", "max_num_batched_tokens"} and k["max_num_seqs"] > k["max_num_batched_tokens"]:
        bad |= {"max_num_seqs", "max_num_batched_tokens"}
    if k["chunk_size"] is not None:
        if not _is_int(k["chunk_size"]) or k["chunk_size"] < 1:
            bad.add("chunk_size")
        elif _is_int(k["max_num_batched_tokens"]) and k["chunk_size"] > k["max_num_batched_tokens"]:
            bad |= {"chunk_size", "max_num_batched_tokens"}
    ratio = k["prefill_token_ratio"]
    if isinstance(ratio, bool) or not 0 < ratio <= 1:
        bad.add("prefill_token_ratio")
    if not _is_int(k["block_size"]) or not 1 <= k["block_size"] <= 256:
        bad.add("block_size")
    if k["max_model_len"] is not None and not 2 <= k["max_model_len"] <= LIMITS.max_context_len:
        bad.add("max_model_len")
    if k["preemption_mode"] not in ("recompute", "swap"):
        bad.add("preemption_mode")
    if k["scheduling_policy"] not in ("fcfs", "priority"):
        bad.add("scheduling_policy")
    if not isinstance(k["enable_prefix_caching"], bool):
        bad.add("enable_prefix_caching")
    if not bad & {"block_size", "max_model_len", "kv_cache_bytes"}:
        model_len = k["max_model_len"] or LIMITS.max_context_len
        needed = -(-model_len // k["block_size"])
        if k["num_kv_blocks"] is not None:
            if not _is_int(k["num_kv_blocks"]) or k["num_kv_blocks"] < needed:
                bad |= {"num_kv_blocks", "block_size", "max_model_len"}
        elif k["kv_cache_bytes"] // (LIMITS.kv_bytes_per_token * k["block_size"]) < needed:
            bad |= {"kv_cache_bytes", "block_size", "max_model_len"}
    return bad


@examples(400)
@given(knobs=st.fixed_dictionaries(KNOB_VALUES))
def test_config_is_accepted_exactly_when_valid(knobs: dict[str, Any]) -> None:
    bad = violations(knobs)
    try:
        config = EngineConfig.create(LIMITS, **knobs)
    except ConfigError as error:
        assert bad, f"a valid config was refused: {error}"
        assert error.knob in bad, f"{error.knob} named, but the broken constraint involves {sorted(bad)}"
        assert error.knob in str(error) and repr(error.value) in str(error)
        return
    assert not bad, f"accepted although {sorted(bad)} break a rule"
    assert config.max_chunk() <= config.max_num_batched_tokens
    assert 1 <= config.max_prefill_tokens_per_step() <= config.max_num_batched_tokens
    assert config.resolved_num_kv_blocks(LIMITS) * config.block_size >= config.resolved_max_model_len(LIMITS)


@examples(200)
@given(changes=st.fixed_dictionaries({}, optional=KNOB_VALUES))
def test_update_is_all_or_nothing(changes: dict[str, Any]) -> None:
    """An update either yields a new generation with exactly these changes, or raises and yields nothing; the
    current config never changes."""
    old = EngineConfig.create(LIMITS, **SMALL)
    snapshot = old.knobs()
    merged = {**snapshot, **changes}
    try:
        new = old.updated(LIMITS, **changes)
    except ConfigError as error:
        assert violations(merged)
        assert error.knob in violations(merged)
    else:
        assert not violations(merged)
        assert new.generation == old.generation + 1
        assert new.knobs() == merged
        assert new.changed_knobs(old) == {k for k, v in changes.items() if snapshot[k] != v}
    assert old.knobs() == snapshot and old.generation == 0


def test_the_name_knobs_types_list_exactly_the_knob_schemas_choices() -> None:
    """The Literal types a type checker sees and the choices the engine, the policies and the metrics use are one
    list each: a choice added to one and not the other fails here."""
    from typing import get_args

    from engine.config import KernelBackend, PreemptionMode, SchedulingPolicy
    from engine.knobs import KNOB_BY_NAME

    for name, literal in (("preemption_mode", PreemptionMode), ("scheduling_policy", SchedulingPolicy),
                          ("kernel_backend", KernelBackend)):
        assert get_args(literal) == KNOB_BY_NAME[name].choices, name


def test_the_knob_gauges_help_names_every_choice_by_its_index() -> None:
    """A dashboard reading slotune_knob{name="kernel_backend"} 2 learns from the help that 2 is cpp."""
    from engine.knobs import KNOBS
    from engine.metrics import KNOB_GAUGE_HELP

    for k in KNOBS:
        if k.choices:
            assert f"{k.name}: " + ", ".join(f"{i} {c}" for i, c in enumerate(k.choices)) in KNOB_GAUGE_HELP
    assert "kernel_backend: 0 auto, 1 torch, 2 cpp, 3 triton" in KNOB_GAUGE_HELP
