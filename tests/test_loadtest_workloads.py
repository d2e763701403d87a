"""Workloads and schedules: exact lengths, the 6:3:1 mix, the real Azure traces, Mooncake shared prefixes."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from loadtest.config import LoadConfig
from loadtest.schedule import build_schedule
from loadtest.tokens import PromptBuilder, TokenSpace
from loadtest.traces import AzureTraceWorkload, MooncakeTraceWorkload
from tests import trace_files
from loadtest.workloads import (LengthOptions, MixedWorkload,
                                PrefixWorkload, parse_mix)

REPO = Path(__file__).resolve().parents[1]
# the real traces: the full ones where present, else the excerpts the repository ships (tests/trace_files.py)
CODE_TRACE, CONV_TRACE = trace_files.CODE, trace_files.CONV
CODE, CONV = CODE_TRACE.path, CONV_TRACE.path


def take(workload, n):
    return list(itertools.islice(workload.specs(), n))


def test_prompts_have_exactly_the_requested_length():
    builder = PromptBuilder(TokenSpace(seed=3, low=100, high=32000))
    specs = take(MixedWorkload(parse_mix("a=1:1,b=7-300:2-9,c=4096:5", "1:1:1"), seed=3), 60)
    for s in specs:
        ids = builder.tokens(s.segments, s.prompt_len)
        assert len(ids) == s.prompt_len
        assert all(isinstance(t, int) and 100 <= t < 32000 for t in ids)
    lengths = Counter((s.kind, s.prompt_len) for s in specs if s.kind != "b")
    assert set(lengths) == {("a", 1), ("c", 4096)}
    assert all(7 <= s.prompt_len <= 300 and 2 <= s.output_len <= 9 for s in specs if s.kind == "b")


def test_mixed_is_6_3_1_in_every_block_of_ten():
    specs = take(MixedWorkload(seed=0), 1000)
    for block in range(0, 1000, 10):
        assert Counter(s.kind for s in specs[block:block + 10]) == {"short": 6, "medium": 3, "long": 1}
    assert {(s.kind, s.prompt_len, s.output_len) for s in specs} == {
        ("short", 128, 32), ("medium", 512, 128), ("long", 2048, 256)}
    assert [s.index for s in specs] == list(range(1000))
    # unique prompts: no two requests share leading tokens by construction
    builder = PromptBuilder(TokenSpace())
    firsts = {tuple(builder.tokens(s.segments, s.prompt_len)[:8]) for s in specs[:50]}
    assert len(firsts) == 50


def test_seed_determinism():
    a, b, c = (take(MixedWorkload(seed=s), 30) for s in (1, 1, 2))
    assert a == b and a != c
    builder = PromptBuilder(TokenSpace(seed=1))
    assert builder.tokens(a[0].segments, a[0].prompt_len) == PromptBuilder(TokenSpace(seed=1)).tokens(
        a[0].segments, a[0].prompt_len)


def test_length_scale_and_clipping():
    w = MixedWorkload(lengths=LengthOptions(length_scale=0.25, output_scale=0.5), seed=0)
    assert {(s.kind, s.prompt_len, s.output_len) for s in take(w, 20)} == {
        ("short", 32, 16), ("medium", 128, 64), ("long", 512, 128)}
    w = MixedWorkload(lengths=LengthOptions(max_context=600), seed=0)
    specs = take(w, 20)
    assert all(s.prompt_len + s.output_len <= 600 for s in specs)
    assert {(s.kind, s.prompt_len, s.output_len) for s in specs if s.kind == "long"} == {("long", 344, 256)}
    assert w.clipped == sum(s.kind != "short" for s in specs)  # 512+128 and 2048+256 exceed 600


@pytest.mark.parametrize("trace", [CODE_TRACE, CONV_TRACE], ids=["code", "conv"])
def test_azure_traces_parse(trace):
    path = trace.path
    w = AzureTraceWorkload(str(path))
    assert len(w.rows) == trace.rows
    assert w.rows[0].time == 0.0 and all(a.time <= b.time for a, b in zip(w.rows, w.rows[1:]))
    assert w.mean_rate == pytest.approx(trace.mean_rate, abs=0.01)  # the traces' README figures
    with open(path) as f:
        f.readline()
        first = f.readline().strip().split(",")
    spec = next(w.specs())
    assert (spec.prompt_len, spec.output_len) == (int(first[1]), int(first[2]))
    if path == CONV:  # second row: 2023-11-16 18:15:50.9951690, first 18:15:46.6805900 -> 4.3145790 s apart
        assert w.rows[1].time == pytest.approx(4.314579, abs=1e-6)
        prompts = np.array([r.prompt for r in w.rows])
        assert np.percentile(prompts, 50) == pytest.approx(trace.prompt_p50, abs=1)


def test_trace_schedule_time_scale_rate_and_limits():
    path = str(CONV)
    s = build_schedule(LoadConfig(workload=path, duration=120.0, time_scale=2.0))
    w = AzureTraceWorkload(path)
    n = sum(r.time * 2.0 < 120.0 for r in w.rows)
    assert len(s) == n and s.meta["arrival"] == "trace" and s.meta["time_scale"] == 2.0
    assert [r.at for r in s.requests] == pytest.approx([r.time * 2.0 for r in w.rows[:n]])
    # --rate rescales the trace to that mean rate
    s = build_schedule(LoadConfig(workload=path, duration=600.0, rate=2.0))
    assert s.meta["time_scale"] == pytest.approx(CONV_TRACE.mean_rate / 2.0, rel=0.01)
    assert s.meta["offered_rps"] == pytest.approx(2.0, rel=0.25)
    # a request limit and a length scale with clipping
    s = build_schedule(LoadConfig(workload=path, duration=600.0, max_requests=25, length_scale=0.5, max_context=512))
    assert len(s) == 25 and all(r.prompt_len + r.output_len <= 512 for r in s.requests)
    assert s.duration_s < 600.0  # the rate is over the span the 25 requests cover
    # with a synthetic arrival process the trace gives only the lengths, in order
    s = build_schedule(LoadConfig(workload=path, duration=10.0, rate=5.0, arrival="poisson"))
    assert [(r.prompt_len, r.output_len) for r in s.requests] == [(x.prompt, x.output) for x in w.rows[:len(s)]]


def test_trace_segment_seed_draws_another_segment_at_the_same_rate():
    """A fresh arrival draw of a trace is another segment of it: the same seed the same segment (common random
    numbers), another seed another one; each segment at the rate asked (its own gaps scaled to offer it), so that
    segments differ in the shape of their bursts and lengths, not in their load."""
    path = str(CONV)
    base = LoadConfig(workload=path, duration=60.0, rate=1.0)
    first = build_schedule(base)
    a = build_schedule(LoadConfig(**{**base.to_dict(), "trace_segment_seed": 3}))
    b = build_schedule(LoadConfig(**{**base.to_dict(), "trace_segment_seed": 3}))
    c = build_schedule(LoadConfig(**{**base.to_dict(), "trace_segment_seed": 4}))
    assert [(r.at, r.prompt_len) for r in a.requests] == [(r.at, r.prompt_len) for r in b.requests]
    assert first.meta["time_scale"] == pytest.approx(CONV_TRACE.mean_rate, rel=0.01)  # no segment: the whole trace
    w = AzureTraceWorkload(path)
    for s in (a, c):
        needed = 60.0 / s.meta["time_scale"]
        start = s.meta["trace_offset_s"]
        assert 0 < start <= w.span_s - needed
        # exactly the trace's rows of that segment, at its own scale
        rows = [r for r in w.rows if start <= r.time and (r.time - start) * s.meta["time_scale"] < 60.0]
        assert [x.prompt_len for x in s.requests] == [r.prompt for r in rows]
        assert [x.at for x in s.requests] == pytest.approx([(r.time - start) * s.meta["time_scale"] for r in rows])
    assert a.meta["trace_offset_s"] != c.meta["trace_offset_s"]
    # every segment offers the rate asked (one request fewer where two rows share the timestamp at its end),
    # though the trace's own rate varies from segment to segment
    draws = [build_schedule(LoadConfig(**{**base.to_dict(), "trace_segment_seed": k})) for k in range(40)]
    assert all(abs(len(s) - 60) <= 1 and s.meta["offered_rps"] == pytest.approx(1.0, rel=0.05) for s in draws)
    own = [1.0 * s.meta["time_scale"] for s in draws]  # each segment's own rate (requests per second of trace time)
    assert max(own) / min(own) > 1.2
    with pytest.raises(ValueError, match="trace-segment-seed"):
        build_schedule(LoadConfig(workload="mixed", duration=10.0, rate=1.0, trace_segment_seed=1))


def write_mooncake(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_mooncake_shared_prefixes(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_mooncake(path, [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 1500, "output_length": 20, "hash_ids": [1, 2, 4]},
        {"timestamp": 1000, "input_length": 700, "output_length": 5, "hash_ids": [1, 5]},
        {"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [6, 7]},
    ])
    w = MooncakeTraceWorkload(str(path))
    specs = take(w, 4)
    b = PromptBuilder(TokenSpace(seed=0))
    p = [b.tokens(s.segments, s.prompt_len) for s in specs]
    assert [len(x) for x in p] == [1100, 1500, 700, 600]
    assert [s.trace_time for s in specs] == [0.0, 0.5, 1.0, 1.5]
    assert p[0][:1024] == p[1][:1024] and p[0][1024:1100] != p[1][1024:1100]  # blocks 1, 2 shared; 3 vs 4 not
    assert p[0][:512] == p[2][:512] and p[0][512:700] != p[2][512:700]  # block 1 shared
    assert p[3][:512] != p[0][:512]  # nothing shared
    # the block size scales with the length scale, so shares keep their proportion
    ws = MooncakeTraceWorkload(str(path), lengths=LengthOptions(length_scale=0.25))
    assert ws.block_len == 128
    q = [b.tokens(s.segments, s.prompt_len) for s in take(ws, 3)]
    assert [len(x) for x in q] == [275, 375, 175]
    assert q[0][:256] == q[1][:256] and q[0][256:275] != q[1][256:275]
    assert q[0][:128] == q[2][:128] and q[0][128:175] != q[2][128:175]
    # a schedule from it keeps the trace's times
    s = build_schedule(LoadConfig(workload=str(path), duration=10.0))
    assert [r.at for r in s.requests] == [0.0, 0.5, 1.0, 1.5] and s.meta["format"] == "mooncake-jsonl"


def test_prefix_groups_share_a_system_prompt():
    w = PrefixWorkload(groups=3, prefix_len="200", suffix_len="10-20", output_len="5", seed=1)
    specs = take(w, 40)
    b = PromptBuilder(TokenSpace())
    by_group: dict[str, list[list[int]]] = {}
    for s in specs:
        ids = b.tokens(s.segments, s.prompt_len)
        assert len(ids) == s.prompt_len and 210 <= s.prompt_len <= 220
        by_group.setdefault(s.kind, []).append(ids)
    assert len(by_group) == 3
    for prompts in by_group.values():
        assert all(x[:200] == prompts[0][:200] for x in prompts)
        assert len({tuple(x[200:]) for x in prompts}) == len(prompts)
    heads = {tuple(p[0][:200]) for p in by_group.values()}
    assert len(heads) == 3


def test_schedule_split_keeps_every_request_once():
    s = build_schedule(LoadConfig(rate=50.0, duration=20.0, seed=4))
    shares = [s.share(r, 3) for r in range(3)]
    indices = sorted(x.index for sh in shares for x in sh)
    assert indices == list(range(len(s)))
    assert all(sh == sorted(sh, key=lambda x: x.at) for sh in shares)
    assert abs(len(shares[0]) - len(shares[2])) <= 1


def test_bad_options_are_reported():
    with pytest.raises(ValueError, match="an existing trace file"):
        build_schedule(LoadConfig(workload="nope.csv"))
    with pytest.raises(ValueError, match="--duration"):
        LoadConfig.from_strings({"duration": "soon"})
    with pytest.raises(ValueError, match="weights"):
        parse_mix("a=1:1,b=2:2", "1")
    with pytest.raises(ValueError, match="trace"):
        build_schedule(LoadConfig(arrival="trace"))
