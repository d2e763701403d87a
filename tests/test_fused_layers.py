"""The C++ kernels (engine/csrc/, built by engine/fused_layers.py): the fused layer loop computes exactly what the
Python layer loop computes (same hidden states, same KV cache writes, bit for bit), and the small-batch linear agrees
with ATen's to float rounding, takes a bias, and leaves larger batches to ATen. That greedy outputs stay token-identical
to transformers with both is tests/test_engine_equivalence.py's job."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from engine import LLM, fused_layers
from engine.attention import AttentionMetadata, DecodeGroup, PrefillChunk, paged_attention


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, block_size=16)


def decode_only() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Three sequences decoding (contexts 33, 40, 57 with the new token: the shorter ones masked)."""
    contexts = [33, 40, 57]
    tables = torch.tensor([[0, 1, 2, 0], [3, 4, 5, 0], [6, 7, 8, 9]])
    slots = torch.tensor([int(tables[i, (c - 1) // 16]) * 16 + (c - 1) % 16 for i, c in enumerate(contexts)])
    mask = (torch.arange(57)[None, :] < torch.tensor(contexts)[:, None])[:, None, None, :]
    meta = AttentionMetadata(slot_mapping=slots, decode_groups=[DecodeGroup(0, 3, tables, 57, mask,
                                                                                   torch.tensor(contexts))])
    return torch.tensor([1200, 7, 31000]), torch.tensor(contexts) - 1, meta


def mixed() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Two decode groups (one sequence each), a first prefill chunk (nothing cached) and a later chunk of a
    sequence with 20 tokens cached."""
    ids, positions, slots = [5, 9], [29, 139], [10 * 16 + 13, 20 * 16 + 11]
    groups = [DecodeGroup(0, 1, torch.tensor([[10, 11]]), 30, None, torch.tensor([30])),
              DecodeGroup(1, 2, torch.tensor([[12 + i for i in range(8)] + [20]]), 140, None, torch.tensor([140]))]
    first = list(range(6))  # a 6-token prompt's first chunk, blocks 30
    ids += [100 + i for i in first]
    positions += first
    slots += [30 * 16 + i for i in first]
    later = list(range(20, 28))  # tokens 20..27 of a sequence on blocks 40, 41
    ids += [300 + i for i in later]
    positions += later
    slots += [(40 + p // 16) * 16 + p % 16 for p in later]
    chunk_positions = torch.tensor(later)
    chunks = [PrefillChunk(2, 8, 6, torch.tensor([30]), None),
              PrefillChunk(8, 16, 28, torch.tensor([40, 41]), torch.arange(28)[None, :] <= chunk_positions[:, None])]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), decode_groups=groups, prefills=chunks)
    return torch.tensor(ids), torch.tensor(positions), meta


@pytest.mark.parametrize("batch", [decode_only, mixed])
def test_fused_layer_loop_is_bit_identical_to_the_python_loop(llm: LLM, batch) -> None:
    model, kv = llm.engine.model, llm.engine.runner.kv_cache
    assert model.kernels is not None and model.fused_loop, "the C++ kernels were not built (they need g++ and ninja)"
    generator = torch.Generator().manual_seed(0)
    kv.key.copy_(torch.randn(kv.key.shape, generator=generator))  # cached context
    kv.value.copy_(torch.randn(kv.value.shape, generator=generator))
    ids, positions, meta = batch()
    key0, value0 = kv.key.clone(), kv.value.clone()

    fused_hidden = model.forward(ids, positions, meta, kv)
    fused_key, fused_value = kv.key.clone(), kv.value.clone()
    kv.key.copy_(key0)
    kv.value.copy_(value0)
    model.fused_loop = False
    try:
        python_hidden = model.forward(ids, positions, meta, kv)
    finally:
        model.fused_loop = True
    assert torch.equal(fused_hidden, python_hidden)
    assert torch.equal(fused_key, kv.key) and torch.equal(fused_value, kv.value)
    assert not torch.equal(key0, kv.key)  # the step did write the new tokens' keys


def test_the_layer_loops_records_take_names_only_and_refuse_lists_out_of_step(llm: LLM) -> None:
    """The C++ layer loop's arguments are three records made by keyword: a list in another's place cannot be passed
    by position, and lists of different lengths are refused when the record is made, not computed with."""
    kernels = llm.engine.model.kernels
    w = torch.ones(4)
    with pytest.raises(TypeError):
        kernels.ModelDims(9, 3, 64, 1e-5, 0.125)  # positional: refused
    with pytest.raises(RuntimeError, match="LayerWeights: a list holds 1 layers, qkv 2"):
        kernels.LayerWeights(input_norm=[w], qkv=[w, w], qkv_bias=[], o_proj=[w, w], post_norm=[w, w],
                             gate_up=[w, w], down=[w, w])
    with pytest.raises(RuntimeError, match="StepPlan: the decode lists differ in length"):
        kernels.StepPlan(decode_start=[0], decode_end=[1, 2], decode_tables=[w], decode_context_lens=[w],
                         prefill_start=[], prefill_end=[], prefill_context=[], prefill_tables=[], prefill_masks=[])
    with pytest.raises(RuntimeError, match="ModelDims: num_heads must be a multiple of num_kv_heads"):
        kernels.ModelDims(num_heads=9, num_kv_heads=4, head_dim=64, eps=1e-5, scale=0.125)


def test_the_model_weights_live_in_one_packed_buffer_in_forward_order(llm: LLM) -> None:
    model = llm.engine.model
    weights = model._weights_in_forward_order()
    storage = weights[0].untyped_storage().data_ptr()
    addresses = [w.data_ptr() for w in weights]
    assert all(w.untyped_storage().data_ptr() == storage for w in weights)
    assert addresses == sorted(addresses) and all(a % 64 == 0 for a in addresses)
    assert storage % (2 << 20) == 0  # huge-page aligned, so the kernel can back it with 2 MB pages
    assert model.embed_tokens is model.lm_head  # SmolLM2 ties them: one copy, streamed last


def test_pack_weights_copies_values_shapes_and_dtypes() -> None:
    kernels = fused_layers.load()
    assert kernels is not None
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(2, 3, 4).transpose(0, 2),
               torch.ones(0)]
    packed = kernels.pack_weights(tensors)
    for original, copy in zip(tensors, packed, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape and copy.is_contiguous()
        assert torch.equal(copy, original)
    tensors[0].add_(1)  # a copy, not a view of the original
    assert not torch.equal(packed[0], tensors[0])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("features", [576, 100])  # 100: not a multiple of the 16-float vectors
def test_small_batch_linear_matches_aten(llm: LLM, rows: int, features: int) -> None:
    kernels = llm.engine.model.kernels
    assert kernels is not None
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, features, generator=generator)
    weight = torch.randn(1003, features, generator=generator)  # 1003 outputs: a partial block of rows at the end
    bias = torch.randn(1003, generator=generator)
    torch.testing.assert_close(kernels.linear(x, weight, None), torch.nn.functional.linear(x, weight),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-4)
    transposed = x.t().contiguous().t()  # a non-contiguous input is read correctly
    torch.testing.assert_close(kernels.linear(transposed, weight, None), torch.nn.functional.linear(x, weight),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [7, 8, 9, 31, 64])
@pytest.mark.parametrize("features", [576, 100])
def test_tiled_linear_matches_aten(llm: LLM, rows: int, features: int) -> None:
    """7+ rows: tiles of 3 input rows x 8 weight rows, with partial tiles of both at the edges."""
    kernels = llm.engine.model.kernels
    assert kernels is not None
    generator = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, features, generator=generator), torch.randn(1003, features, generator=generator)
    bias, residual = torch.randn(1003, generator=generator), torch.randn(rows, 1003, generator=generator)
    expected = torch.nn.functional.linear(x, weight, bias)
    limit = kernels.get_tiled_rows_limit()  # measured on this machine; the tiles are tested whatever it chose
    kernels.set_tiled_rows_limit(512)
    try:
        torch.testing.assert_close(kernels.linear(x, weight, bias), expected, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(kernels.linear(x, weight, bias, residual), residual + expected, rtol=1e-5,
                                   atol=1e-4)
    finally:
        kernels.set_tiled_rows_limit(limit)


def test_linear_above_the_tiled_limit_is_atens(llm: LLM) -> None:
    kernels = llm.engine.model.kernels
    assert kernels is not None
    limit = kernels.get_tiled_rows_limit()
    x, weight = torch.randn(7, 576), torch.randn(300, 576)
    kernels.set_tiled_rows_limit(6)
    try:
        assert torch.equal(kernels.linear(x, weight, None), torch.nn.functional.linear(x, weight))
    finally:
        kernels.set_tiled_rows_limit(limit)
    assert kernels.linear(torch.randn(0, 576), weight, None).shape == (0, 300)
    with pytest.raises(RuntimeError, match="input has 500 features, weight expects 576"):
        kernels.linear(torch.randn(1, 500), weight, None)
    with pytest.raises(RuntimeError, match="must be >= 0"):
        kernels.set_tiled_rows_limit(-1)


def test_the_tiled_limit_is_measured_once_per_machine_and_can_be_overridden(
        llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = llm.engine.model.kernels
    assert kernels is not None
    before, before_bf16 = kernels.get_tiled_rows_limit(), kernels.get_tiled_rows_limit(True)
    limit, timings = fused_layers.measure_tiled_rows_limit(kernels, rows=(8, 16), weight_bytes=4 << 20)
    assert limit in (6, 8, 16) and set(timings) <= {"8", "16"} and kernels.get_tiled_rows_limit() == before
    monkeypatch.delenv(fused_layers.TILED_ROWS_ENV, raising=False)
    monkeypatch.delenv(fused_layers.BF16_TILED_ROWS_ENV, raising=False)
    (tmp_path / fused_layers.MEASUREMENTS_FILE).write_text('{"tiled_rows_limit": 24, "bf16_tiled_rows_limit": 12}')
    assert fused_layers.tiled_rows_limit(kernels, tmp_path) == 24  # kept from the first measurement
    assert fused_layers.tiled_rows_limit(kernels, tmp_path, bf16=True) == 12
    monkeypatch.setenv(fused_layers.TILED_ROWS_ENV, "6")
    monkeypatch.setenv(fused_layers.BF16_TILED_ROWS_ENV, "8")
    assert fused_layers.tiled_rows_limit(kernels, tmp_path) == 6
    assert fused_layers.tiled_rows_limit(kernels, tmp_path, bf16=True) == 8
    limit, timings = fused_layers.measure_tiled_rows_limit(kernels, rows=(2, 8), weight_bytes=2 << 20, bf16=True)
    assert limit in (1, 2, 8) and set(timings) == ({"2"} if limit == 1 else {"2", "8"})
    assert kernels.get_tiled_rows_limit(True) == before_bf16


def test_the_first_row_count_the_library_wins_ends_the_kernels_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """A later win (noise, or a kernel that catches up) does not reopen the range: rows between would run the
    slower kernel."""
    wins = {2: True, 3: True, 4: False, 8: True}
    monkeypatch.setattr(fused_layers, "_decoder_weights", lambda *_: [])
    monkeypatch.setattr(fused_layers, "_median_times",
                        lambda linears, weights, m, repeats: [1.0, 2.0] if wins[m] else [2.0, 1.0])

    class Module:
        limit = 99

        def get_tiled_rows_limit(self, bf16: bool) -> int:
            return self.limit

        def set_tiled_rows_limit(self, rows: int, bf16: bool) -> None:
            self.limit = rows

    module = Module()
    limit, timings = fused_layers.measure_tiled_rows_limit(module, rows=(8, 2, 4, 3), bf16=True)
    assert limit == 3 and set(timings) == {"2", "3", "4"} and module.limit == 99
    wins[2] = False
    assert fused_layers.measure_tiled_rows_limit(module, rows=(2, 3), bf16=True)[0] == 1  # bf16's floor: one row
    assert fused_layers.measure_tiled_rows_limit(module, rows=(2, 3), bf16=False)[0] == 6  # fp32's: its gemv


def test_kernels_called_from_several_threads_at_once_stay_correct(llm: LLM) -> None:
    """One caller at a time uses the work pool; a concurrent caller runs its loop alone, with the same result."""
    kernels = llm.engine.model.kernels
    assert kernels is not None
    x, weight = torch.randn(5, 576), torch.randn(2000, 576)  # the streaming kernel: tiled or not on any machine
    expected = kernels.linear(x, weight, None)
    results: list[bool] = []

    def call() -> None:
        results.extend(torch.equal(kernels.linear(x, weight, None), expected) for _ in range(50))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 150 and all(results)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("contexts", "heads", "kv_heads", "dim"), [
    ([1, 7, 33, 130], 9, 3, 64),  # SmolLM2's heads, a batch: one slice per context
    ([257], 9, 3, 64),  # batch 1: each context split into slices, merged after
    ([300, 5], 8, 1, 128),  # a group of 8 query heads per KV head (in register-sized parts); empty slices
    ([40, 90], 4, 4, 80),  # no grouping; a head size the vector kernel does not cover (the scalar loop)
    ([1], 2, 2, 64),
])
def test_decode_attention_reads_the_paged_cache_like_torch_attention(llm: LLM, block_size: int, contexts: list[int],
                                                                     heads: int, kv_heads: int, dim: int) -> None:
    """Against gather + scaled_dot_product_attention (engine/attention.py without the kernels): sequences of
    different context lengths on shuffled blocks."""
    kernels = llm.engine.model.kernels
    assert kernels is not None
    generator = torch.Generator().manual_seed(block_size)
    num_blocks = sum(-(-c // block_size) for c in contexts) + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator) * 2
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    width = -(-max(contexts) // block_size)
    tables = []
    for context in contexts:
        used = [order.pop() for _ in range(-(-context // block_size))]
        tables.append(used + [0] * (width - len(used)))
    table_tensor, lens = torch.tensor(tables), torch.tensor(contexts)
    query = torch.randn(len(contexts), heads, dim, generator=generator)
    mask = (torch.arange(max(contexts))[None, :] < lens[:, None])[:, None, None, :]
    group = DecodeGroup(0, len(contexts), table_tensor, max(contexts), mask, lens)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), decode_groups=[group])
    scale = dim ** -0.5
    kv = query[:, :kv_heads]  # (unused: decode attention reads the cache)
    expected = paged_attention(query, kv, kv, key_cache, value_cache, meta, scale, None)
    got = kernels.decode_attention(query, key_cache, value_cache, table_tensor, lens, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="outside the block table"):
        kernels.decode_attention(query, key_cache, value_cache, table_tensor, lens + width * block_size, scale)


def test_rms_norm_matches_torch(llm: LLM) -> None:
    kernels = llm.engine.model.kernels
    assert kernels is not None
    x, weight = torch.randn(70, 100) * 3, torch.randn(100)  # 100: not a multiple of the 16-float vectors
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5), torch.nn.functional.rms_norm(x, (100,), weight, 1e-5),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="weight has 99 elements, rows have 100"):
        kernels.rms_norm(x, weight[:99], 1e-5)


def test_without_the_kernels_greedy_tokens_are_the_same(llm: LLM) -> None:
    """The fallback where the kernels cannot be built (no compiler, SLOTUNE_FUSED_LAYERS=0): torch's linear, norm
    and gathered attention in the Python loop generate the same greedy tokens, for decodes of mixed context
    lengths (several decode groups with masks) and prefill chunks beside them."""
    from engine import SamplingParams

    prompts = [[100 + (7 * i + j) % 900 for j in range(n)] for i, n in enumerate([5, 40, 90, 17, 60])]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with_kernels = [out.token_ids for out in llm.generate(prompts, params)]
    model = llm.engine.model
    kernels = model.kernels
    model.kernels, model.fused_loop = None, False
    try:
        without = [out.token_ids for out in llm.generate(prompts, params)]
    finally:
        model.kernels, model.fused_loop = kernels, True
    assert without == with_kernels


def test_rotary_cache_write_and_silu_match_torch(llm: LLM) -> None:
    model = llm.engine.model
    kernels = model.kernels
    assert kernels is not None
    generator = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim = 5, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator)
    positions = torch.tensor([0, 3, 17, 200, 1999])
    cos, sin = model._rope(positions)
    keys, values = torch.zeros(4, 16, kv_heads, dim), torch.zeros(4, 16, kv_heads, dim)
    slots = torch.tensor([0, 17, 33, 50, 63])
    q, k, v = kernels.rotary_cache_write(qkv, cos, sin, slots, keys, values, heads, kv_heads, dim)
    qk = model._apply_rope(qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim), cos, sin)
    torch.testing.assert_close(q, qk[:, :heads], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, qk[:, heads:], rtol=1e-6, atol=1e-6)
    assert torch.equal(v, qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim))
    assert torch.equal(keys.view(64, kv_heads, dim)[slots], k) and torch.equal(values.view(64, kv_heads, dim)[slots], v)
    assert keys.view(64, kv_heads, dim)[1].abs().sum() == 0  # nothing written elsewhere
    with pytest.raises(RuntimeError, match="slot 64 outside the cache"):
        kernels.rotary_cache_write(qkv, cos, sin, slots + 1, keys, values, heads, kv_heads, dim)

    gate_up = torch.randn(3, 2 * 1544, generator=generator) * 4  # 1544: a tail after the 16-float vectors
    gate_up[0, :200] = torch.linspace(-120, 120, 200)  # where exp under- and overflows
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-7)


def test_linear_adds_the_residual(llm: LLM) -> None:
    kernels = llm.engine.model.kernels
    assert kernels is not None
    weight = torch.randn(40, 64)
    for rows in (2, 9):  # the streaming kernel and ATen's
        x, residual = torch.randn(rows, 64), torch.randn(rows, 40)
        torch.testing.assert_close(kernels.linear(x, weight, None, residual),
                                   residual + torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_a_build_killed_midway_does_not_block_later_starts(llm: LLM) -> None:
    """A build killed midway leaves torch's lock file in the build folder; the next start still loads the kernels
    (instead of waiting on that file forever)."""
    kernels = fused_layers.load()
    assert kernels is not None
    (Path(kernels.build_dir) / fused_layers.TORCH_BUILD_LOCK).touch()
    started = subprocess.run([sys.executable, "-c", "from engine import fused_layers; assert fused_layers.load()"],
                             timeout=300, capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    assert not (Path(kernels.build_dir) / fused_layers.TORCH_BUILD_LOCK).exists()


@pytest.mark.parametrize(("given", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_engine_lets_openmp_threads_sleep_after_a_region_unless_the_user_chose(given: str | None,
                                                                                   expected: str) -> None:
    """OpenMP reads its wait policy when torch loads it: importing the engine first sets it (the user's wins)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": given} if given else {})
    code = "import engine, torch, os; print(os.environ['OMP_WAIT_POLICY'])"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.stdout.strip() == expected
