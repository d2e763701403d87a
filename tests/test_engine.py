"""The engine as a user of the offline API sees it: stop conditions, sampling, validation, aborts, step records,
model sources."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from engine import LLM, ConfigError, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=8, max_num_batched_tokens=128, block_size=16)


def test_max_tokens_and_ignore_eos_give_exact_lengths(llm: LLM) -> None:
    outs = llm.generate(["Hi", "Tell me a story"], SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [17, 17]
    assert all(o.finish_reason == "length" for o in outs)


def test_eos_stops_and_is_not_in_text(llm: LLM) -> None:
    out = llm.chat([[{"role": "user", "content": "Say OK."}]], SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.engine.eos_token_ids
    assert "<|im_end|>" not in out.text


def test_min_tokens_suppresses_eos(llm: LLM) -> None:
    conversation = [[{"role": "user", "content": "Say OK."}]]
    free = llm.chat(conversation, SamplingParams(max_tokens=64, temperature=0.0))[0]
    forced = llm.chat(conversation, SamplingParams(max_tokens=64, temperature=0.0,
                                                   min_tokens=len(free.token_ids) + 5))[0]
    assert len(forced.token_ids) >= len(free.token_ids) + 5
    eos = llm.engine.eos_token_ids
    assert not any(t in eos for t in forced.token_ids[: len(free.token_ids) + 5])


def test_stop_string_truncates_text(llm: LLM) -> None:
    prompt = "Count: 1, 2, 3, 4, 5,"
    full = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert " 8" in full.text, full.text
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=[" 8"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(" 8")]
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_ids(llm: LLM) -> None:
    full = llm.generate(["The alphabet: A B C"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop_id = full.token_ids[4]
    out = llm.generate(["The alphabet: A B C"], SamplingParams(max_tokens=12, temperature=0.0,
                                                                stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]


def test_seeded_sampling_is_reproducible_and_varies_with_seed(llm: LLM) -> None:
    def sample(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=seed, ignore_eos=True)
        return llm.generate(["Write a sentence about cats."], params)[0].token_ids

    assert sample(1) == sample(1)
    assert len({tuple(sample(s)) for s in range(4)}) > 1


def test_top_k_one_is_greedy(llm: LLM) -> None:
    prompt = ["The capital of France is"]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    top1 = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.8, top_k=1, seed=3, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids


def test_streamed_text_deltas_add_up(llm: LLM) -> None:
    engine = llm.engine
    rid = engine.add_request("Write two lines about the moon.", SamplingParams(max_tokens=30, temperature=0.0,
                                                                                stop=["moon."]))
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                pieces.append(out.new_text)
                final = out
    assert final is not None and final.finished
    assert "".join(pieces) == final.text


def test_invalid_knobs_are_rejected_and_change_nothing(llm: LLM) -> None:
    before = llm.config
    cases = {
        "max_num_seqs": 0,
        "block_size": 257,
        "chunk_size": 4096,  # above the step budget
        "max_num_batched_tokens": 4,  # below max_num_seqs
        "prefill_token_ratio": 0.0,
        "num_kv_blocks": 3,  # cannot hold one sequence of the model's context
        "preemption_mode": "drop",
    }
    for knob, value in cases.items():
        with pytest.raises(ConfigError) as error:
            llm.update_config(**{knob: value})
        assert error.value.knob == knob and str(value) in str(error.value)
        assert llm.config == before
    with pytest.raises(ConfigError, match="unknown knob"):
        llm.update_config(max_num_seq=4)
    # All-or-nothing: a valid knob next to a bad one is not applied either.
    with pytest.raises(ConfigError):
        llm.update_config(max_num_seqs=4, block_size=0)
    assert llm.config == before


def test_config_update_bumps_generation_in_step_records(llm: LLM) -> None:
    generation = llm.config.generation
    new = llm.update_config(max_num_seqs=4)
    assert new.generation == generation + 1 and llm.config.max_num_seqs == 4
    llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0))
    assert llm.step_records()[-1].config_generation == generation + 1
    llm.update_config(max_num_seqs=8)


def test_over_long_prompt_is_rejected_and_engine_keeps_serving(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * llm.engine.max_model_len], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0.0))[0].finished


def test_bad_token_ids_and_sampling_params_are_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="token ids"):
        llm.engine.add_request([1, 2, 10**9])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)


def test_abort_frees_blocks_at_once(llm: LLM) -> None:
    engine = llm.engine
    ids = [engine.add_request("Tell me about the ocean " * 8, SamplingParams(max_tokens=50, ignore_eos=True))
           for _ in range(4)]
    for _ in range(4):
        engine.step()
    assert engine.scheduler.kv.num_used_blocks > 0
    for rid in ids:
        assert engine.abort_request(rid)
    assert engine.scheduler.kv.num_used_blocks == 0
    assert not engine.has_unfinished_requests()
    assert not engine.abort_request(ids[0])


def test_step_records_describe_every_step(llm: LLM) -> None:
    last = llm.step_records()[-1].step if llm.step_records() else -1
    llm.generate(["a b c d e f g h"] * 3, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    records = llm.step_records(since=last)
    assert [r.step for r in records] == list(range(last + 1, last + 1 + len(records)))
    # The first token of each request comes out of its prefill, each later one out of one decode token.
    assert sum(r.num_decode_tokens for r in records) == 3 * 4
    assert sum(r.num_prefill_tokens for r in records) == 3 * len(llm.tokenizer("a b c d e f g h")["input_ids"])
    for r in records:
        assert r.total_s >= r.forward_s >= 0 and r.kv_blocks_used + r.kv_blocks_free == llm.engine.scheduler.kv.pool.num_blocks
        assert set(dataclasses.asdict(r)) >= {"schedule_s", "sample_s", "num_running", "num_waiting",
                                              "num_preempted", "num_preemptions", "prefix_cache_hit_tokens"}


def test_bfloat16_option_generates(model_dir: Path) -> None:
    llm = LLM(dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=64)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert "Paris" in out.text


@pytest.mark.slow  # ~40 s: a GGUF conversion of its own (the default model's first load converts the same file)
def test_local_folder_and_gguf_file_as_model(tmp_path: Path, model_dir: Path, capfd) -> None:
    # A copy of a Hugging Face folder loads as model=PATH.
    folder = tmp_path / "hf-model"
    shutil.copytree(model_dir, folder)
    from_folder = LLM(model=str(folder), max_num_seqs=2, max_num_batched_tokens=32)
    expected = from_folder.generate(["Hello"], SamplingParams(max_tokens=5, temperature=0.0))[0].token_ids
    # A GGUF file converts once into the given cache folder, with a progress message, then loads from the cache.
    from engine.model_loader import default_gguf_path

    from_gguf = LLM(model=str(default_gguf_path()), cache_dir=tmp_path / "cache", max_num_seqs=2,
                    max_num_batched_tokens=32)
    assert "converting" in capfd.readouterr().err
    assert from_gguf.generate(["Hello"], SamplingParams(max_tokens=5, temperature=0.0))[0].token_ids == expected
    LLM(model=str(default_gguf_path()), cache_dir=tmp_path / "cache", max_num_seqs=2, max_num_batched_tokens=32)
    assert "converting" not in capfd.readouterr().err
