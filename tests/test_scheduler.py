"""Property tests of the scheduler (and, through it, the KV cache's bookkeeping), driven without a model.

A simulated step loop stands in for the runner: `schedule()`, then a fake forward pass that keeps a shadow copy
of the paged KV cache (which token prefix each slot of each block holds, copied on swap-out/in exactly as the
runner does), then `postprocess()` with fake sampled tokens. Requests arrive, are aborted (also while a step runs)
and the config changes live, all at random. Torch-free: nothing here loads a model.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.config import ConfigError, EngineConfig, ModelLimits
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestQueue, Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

LIMITS = ModelLimits(max_context_len=48, kv_bytes_per_token=1)
VOCAB = 4  # a tiny vocabulary: prompts and outputs share prefixes often
EOS = 0
FINISH_REASONS = {"stop", "length", "abort"}
# Two long base prompts; requests take a prefix of one of them plus a random tail, so prefixes are shared.
BASES = [[random.Random(k).randrange(VOCAB) for _ in range(LIMITS.max_context_len)] for k in range(2)]


def examples(n: int, **more: Any) -> settings:
    """Hypothesis settings for these tests: n examples, no deadline and no speed health check (the machines that
    run them are shared and busy)."""
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow], **more)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@st.composite
def engine_knobs(draw: st.DrawFn) -> dict[str, Any]:
    """A valid, small config: tiny KV pools (down to one sequence of max_model_len) so preemption is common."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    max_model_len = draw(st.integers(4, LIMITS.max_context_len))
    min_blocks = cdiv(max_model_len, block_size)
    max_num_seqs = draw(st.integers(1, 8))
    budget = draw(st.integers(max_num_seqs, 2 * max_num_seqs + 8) | st.integers(max_num_seqs, 64))
    return {
        "block_size": block_size,
        "max_model_len": max_model_len,
        "num_kv_blocks": draw(st.integers(min_blocks, 2 * min_blocks + 2)),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": budget,
        "chunk_size": draw(st.none() | st.integers(1, budget)),
        "prefill_token_ratio": draw(st.sampled_from([0.05, 0.3, 0.5, 1.0])),
        "preemption_mode": draw(st.sampled_from(["recompute", "swap"])),
        # kv_bytes_per_token is 1, so swap_space_bytes // block_size host blocks.
        "swap_space_bytes": draw(st.integers(0, 2 * min_blocks)) * block_size,
        "enable_prefix_caching": draw(st.booleans()),
        "scheduling_policy": draw(st.sampled_from(["fcfs", "priority"])),
    }


REQUESTS = st.fixed_dictionaries({
    "base": st.integers(0, 1),
    "fraction": st.integers(0, 100),
    "tail": st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "too_long": st.sampled_from([False] * 9 + [True]),
    "extra": st.integers(0, 3),
    "max_tokens": st.integers(1, 16),
    "min_tokens": st.integers(0, 3),
    "ignore_eos": st.booleans(),
    "priority": st.integers(-2, 2),
})

# Live updates: any subset of knobs, with values that are sometimes invalid (then nothing may change).
KNOB_UPDATES = st.fixed_dictionaries({}, optional={
    "block_size": st.sampled_from([0, 1, 2, 4, 5, 16, 300]),
    "max_model_len": st.integers(1, LIMITS.max_context_len + 2),
    "num_kv_blocks": st.integers(0, 60),
    "max_num_seqs": st.integers(0, 9),
    "max_num_batched_tokens": st.integers(0, 64),
    "chunk_size": st.none() | st.integers(0, 64),
    "prefill_token_ratio": st.sampled_from([0.0, 0.05, 0.3, 1.0, 1.5]),
    "preemption_mode": st.sampled_from(["recompute", "swap"]),
    "swap_space_bytes": st.integers(0, 64),
    "enable_prefix_caching": st.booleans(),
    "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
})


class Sim:
    """A scheduler, the sequences handed to it, and the shadow KV cache of a fake runner."""

    def __init__(self, config: EngineConfig, rnd: random.Random) -> None:
        self.sched = Scheduler(config, LIMITS)
        self.rnd = rnd
        self.seqs: list[Sequence] = []
        self.next_id = 0
        # Prefix identity: (id of tokens[:p], tokens[p]) -> id of tokens[:p+1]; equal ids <=> equal prefixes.
        self._intern: dict[tuple[int, int], int] = {}
        self._pids: dict[Sequence, list[int]] = {}
        # What the device / host KV blocks hold: (block id, slot) -> prefix id of the token whose KV is there.
        self.dev: dict[tuple[int, int], int] = {}
        self.host: dict[tuple[int, int], int] = {}
        self.broken = False

    # Requests -------------------------------------------------------------------------------------------------
    def new_seq(self, prompt: list[int], max_tokens: int, min_tokens: int = 0, ignore_eos: bool = True,
                priority: int = 0) -> Sequence:
        seq = Sequence(f"r{self.next_id}", prompt, SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens,
                                                                   ignore_eos=ignore_eos),
                       eos_token_ids=frozenset({EOS}), priority=priority)
        self.next_id += 1
        return seq

    def add(self, seq: Sequence) -> None:
        self.sched.add(seq)
        self.seqs.append(seq)

    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.finished]

    def prefix_ids(self, seq: Sequence) -> list[int]:
        pids = self._pids.setdefault(seq, [])
        while len(pids) < seq.num_tokens:
            key = (pids[-1] if pids else -1, seq.token_id(len(pids)))
            pids.append(self._intern.setdefault(key, len(self._intern)))
        return pids

    # One step -------------------------------------------------------------------------------------------------
    def step(self, abort_mid_step: int | None = None) -> SchedulerOutput:
        sched = self.sched
        cfg = sched.config
        bs = cfg.block_size
        S = SequenceStatus
        self.broken = True  # until this step has gone through; a failed step leaves nothing to drain
        before = {s: (s.status, s.num_computed_tokens, s.num_preemptions, s.num_output_tokens) for s in self.live()}
        had_work = bool(before)

        out = sched.schedule()

        # Limits of one step.
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert sched.num_running <= cfg.max_num_seqs
        assert len(sched.running) <= cfg.max_num_seqs
        assert out.num_prefill_tokens <= cfg.max_prefill_tokens_per_step()
        if had_work:
            assert out.scheduled, "the scheduler idled while requests were in flight"
        assert len({id(i.seq) for i in out.scheduled}) == len(out.scheduled), "a sequence scheduled twice"

        # Preemptions: counted once per preempted sequence; recompute mode never swaps.
        preempted_now = sum(s.num_preemptions - before[s][2] for s in before)
        assert out.num_preemptions == preempted_now
        if cfg.preemption_mode == "recompute":
            assert not out.swap_out
        for s in before:
            if s.status is S.SWAPPED:
                assert not s.block_table and len(s.host_block_table) == cdiv(s.num_computed_tokens, bs)
            elif s.status is S.PREEMPTED:
                assert not s.block_table and not s.host_block_table and s.num_computed_tokens == 0

        computed_at_schedule = {}
        for item in out.scheduled:
            seq, n = item.seq, item.num_tokens
            status0, c0, pre0, _ = before[seq]
            c = seq.num_computed_tokens
            computed_at_schedule[seq] = c
            assert seq.status is S.RUNNING and seq in sched.running
            assert n >= 1 and c + n <= seq.num_tokens
            assert item.samples == (c + n == seq.num_tokens)
            assert item.is_prefill == seq.in_prefill
            if item.is_prefill:
                assert n <= cfg.max_chunk()
            else:
                assert n == 1 and item.samples
            if pre0 == seq.num_preemptions and status0 in (S.RUNNING, S.SWAPPED):
                assert c == c0, "a sequence's chunks are not contiguous"
            else:
                # (Re)starts from scratch; it may skip only whole cached blocks, never its last token.
                assert status0 in (S.WAITING, S.PREEMPTED) or pre0 < seq.num_preemptions
                assert c % bs == 0 and c < seq.num_tokens
                if not cfg.enable_prefix_caching:
                    assert c == 0
            assert len(seq.block_table) == cdiv(c + n, bs)

        # Ordering: the admitted heads of each queue precede whatever is left in it, and nothing new is
        # admitted while a preempted sequence still waits to come back.
        key = sched.waiting.sort_key
        left_waiting = [s for s in before if s.status is S.WAITING]
        left_preempted = [s for s in before if s.status in (S.PREEMPTED, S.SWAPPED)]
        for item in out.scheduled:
            seq = item.seq
            status0, _, pre0, _ = before[seq]
            if status0 is S.WAITING:
                assert all(key(seq) < key(w) for w in left_waiting), "admitted out of queue order"
                assert not left_preempted, "a new request overtook a preempted one"
            elif status0 in (S.PREEMPTED, S.SWAPPED) or pre0 < seq.num_preemptions:
                assert all(key(seq) < key(w) for w in left_preempted), "resumed out of queue order"

        # Victims are the newest (lowest-priority) running sequences: each is behind every one that kept running.
        victims = [s for s in before if before[s][0] is S.RUNNING and s.num_preemptions > before[s][2]]
        kept = [s for s in before if before[s][0] is S.RUNNING and s.num_preemptions == before[s][2]
                and s.status is S.RUNNING]
        for v in victims:
            assert all(key(v) > key(k) for k in kept), "preempted an older sequence and kept a newer one"

        # The fake forward pass: swap copies first (as the runner does), then every scheduled sequence reads the
        # KV of all its earlier tokens and writes its new tokens.
        for d, h in out.swap_out:
            for slot in range(bs):
                self.host[(h, slot)] = self.dev.get((d, slot), -1)
        for h, d in out.swap_in:
            for slot in range(bs):
                self.dev[(d, slot)] = self.host.get((h, slot), -1)
        pool = sched.kv.pool
        for item in out.scheduled:
            seq, n = item.seq, item.num_tokens
            c = computed_at_schedule[seq]
            pids = self.prefix_ids(seq)
            for p in range(c):
                assert self.dev.get((seq.block_table[p // bs], p % bs)) == pids[p], \
                    f"{seq.request_id} would attend to wrong KV at position {p}"
            for p in range(c, c + n):
                block = pool.blocks[seq.block_table[p // bs]]
                assert block.ref_count == 1 and block.block_hash is None, "writing into a shared or cached block"
                self.dev[(block.block_id, p % bs)] = pids[p]

        aborted = None
        if abort_mid_step is not None and out.scheduled:
            aborted = out.scheduled[abort_mid_step % len(out.scheduled)].seq
            sched.abort(aborted.request_id)

        sampled = [self.rnd.randrange(VOCAB) if item.samples else None for item in out.scheduled]
        finished = sched.postprocess(out, sampled)

        max_len = sched.max_model_len
        for item, token in zip(out.scheduled, sampled):
            seq = item.seq
            if seq is aborted:
                assert seq.finish_reason == "abort" and seq not in finished
                assert seq.num_output_tokens == before[seq][3]
                continue
            assert seq.num_computed_tokens == computed_at_schedule[seq] + item.num_tokens
            if item.samples:
                assert seq.num_output_tokens == before[seq][3] + 1 and seq.output_token_ids[-1] == token
            else:
                assert seq.num_output_tokens == before[seq][3]
            if seq.status.finished:
                assert seq in finished and not seq.block_table
                if seq.finish_reason == "length":
                    assert seq.num_output_tokens == seq.params.max_tokens or seq.num_tokens >= max_len
                else:
                    assert seq.finish_reason == "stop"
                    assert token == EOS and not seq.params.ignore_eos
                    assert seq.num_output_tokens >= seq.params.min_tokens
            else:
                assert seq.num_output_tokens < seq.params.max_tokens and seq.num_tokens < max_len
                if item.samples and not seq.params.ignore_eos and seq.num_output_tokens >= seq.params.min_tokens:
                    assert token != EOS
        assert set(finished) <= {i.seq for i in out.scheduled}
        self.broken = False
        return out

    def drain(self) -> None:
        """Run steps until every request has finished; the scheduler must get there in bounded time."""
        bound = 4 * (len(self.live()) + 1) * (self.sched.max_model_len + 2) + 20
        for _ in range(bound):
            if not self.sched.num_unfinished:
                break
            self.step()
            self.check_invariants()
        assert self.sched.num_unfinished == 0, "requests never finished"
        self.check_invariants()

    # Invariants -----------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        sched = self.sched
        kv, pool, host = sched.kv, sched.kv.pool, sched.kv.host_pool
        bs = kv.block_size
        S = SequenceStatus
        live = self.live()

        # Block accounting: used + free = total; reference counts are what the block tables say.
        assert pool.num_used + pool.num_free == pool.num_blocks
        refs = Counter(b for s in live for b in s.block_table)
        for block in pool.blocks:
            assert block.ref_count >= 0
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: wrong reference count"
        assert pool.num_used == sum(1 for b in pool.blocks if b.ref_count > 0)
        host_used = [h for s in live for h in s.host_block_table]
        assert len(host_used) == len(set(host_used)), "a host block held twice"
        assert len(host_used) + host.num_free == host.num_blocks

        # No request lost: each is finished with a reason, or in exactly the place its status says.
        running = [s for s in sched.running if s.status is S.RUNNING]
        assert len(running) == len(set(running))
        for s in self.seqs:
            places = (s in sched.waiting, s in sched.preempted, s in running)
            if s.status.finished:
                assert s.finish_reason in FINISH_REASONS
                assert places == (False, False, False)
                assert not s.block_table and not s.host_block_table
                assert sched.abort(s.request_id) is None
            elif s.status is S.WAITING:
                assert places == (True, False, False) and not s.block_table and s.num_computed_tokens == 0
            elif s.status is S.PREEMPTED:
                assert places == (False, True, False) and not s.block_table and s.num_computed_tokens == 0
            elif s.status is S.SWAPPED:
                assert places == (False, True, False) and not s.block_table
                assert len(s.host_block_table) == cdiv(s.num_computed_tokens, bs)
            else:
                assert places == (False, False, True)
                assert len(s.block_table) == cdiv(s.num_computed_tokens, bs)
                assert not s.host_block_table
            if not s.status.finished:
                assert s.num_output_tokens < s.params.max_tokens and s.num_tokens < sched.max_model_len
        assert sched.num_unfinished == len(live)
        assert len(sched.waiting) + len(sched.preempted) + len(running) == len(live)
        assert running == sorted(running, key=sched.waiting.sort_key)
        if not live:
            assert pool.num_used == 0 and host.num_free == host.num_blocks, "blocks leaked"


class SchedulerMachine(RuleBasedStateMachine):
    sim: Sim

    @initialize(knobs=engine_knobs(), rnd=st.randoms(use_true_random=False))
    def setup(self, knobs: dict[str, Any], rnd: random.Random) -> None:
        self.sim = Sim(EngineConfig.create(LIMITS, **knobs), rnd)

    @rule(requests=st.lists(REQUESTS, min_size=1, max_size=8))
    def add_requests(self, requests: list[dict[str, Any]]) -> None:
        sim = self.sim
        max_len = sim.sched.max_model_len
        for r in requests:
            # Prompt lengths relative to max_model_len; now and then one that is too long.
            length = max_len + r["extra"] if r["too_long"] else 1 + r["fraction"] * (max_len - 2) // 100
            prompt = (BASES[r["base"]][:length] + r["tail"])[:length]
            seq = sim.new_seq(prompt, r["max_tokens"], min(r["min_tokens"], r["max_tokens"]), r["ignore_eos"],
                              r["priority"])
            if r["too_long"]:
                in_flight = sim.sched.num_unfinished
                with pytest.raises(ValueError, match="max_model_len"):
                    sim.sched.add(seq)
                assert sim.sched.num_unfinished == in_flight and seq.request_id not in {
                    s.request_id for s in sim.sched.in_flight()}
            else:
                sim.add(seq)

    @rule(abort_mid_step=st.none() | st.integers(0, 7))
    def step(self, abort_mid_step: int | None) -> None:
        self.sim.step(abort_mid_step)

    @rule(n=st.integers(1, 6))
    def steps(self, n: int) -> None:
        for _ in range(n):
            self.sim.step()
            self.sim.check_invariants()

    @precondition(lambda self: self.sim.seqs)
    @rule(index=st.integers(0, 100))
    def abort(self, index: int) -> None:
        sim = self.sim
        seq = sim.seqs[index % len(sim.seqs)]
        was_finished = seq.status.finished
        reason = seq.finish_reason
        result = sim.sched.abort(seq.request_id)
        if was_finished:
            assert result is None and seq.finish_reason == reason
        else:
            assert result is seq and seq.status.finished and seq.finish_reason == "abort"
            assert not seq.block_table and not seq.host_block_table

    @rule(changes=KNOB_UPDATES)
    def update_config(self, changes: dict[str, Any]) -> None:
        sim = self.sim
        sched = sim.sched
        old = sched.config
        snapshot = (old, sched.kv, list(sched.running), len(sched.waiting), len(sched.preempted),
                    [(s.status, s.num_computed_tokens, list(s.block_table)) for s in sim.seqs])
        try:
            new = old.updated(LIMITS, **changes)
            sched.apply_config(new)
        except ConfigError as err:
            assert err.knob in EngineConfig.knob_names() and err.knob in str(err)
            # All-or-nothing: the scheduler is exactly as it was.
            assert snapshot == (sched.config, sched.kv, list(sched.running), len(sched.waiting),
                                len(sched.preempted),
                                [(s.status, s.num_computed_tokens, list(s.block_table)) for s in sim.seqs])
            return
        live_before = {s for s in sim.seqs if not snapshot[5][sim.seqs.index(s)][0].finished}
        assert sched.config is new and new.generation == old.generation + 1
        relaid = bool(new.changed_knobs(old) & {"block_size", "num_kv_blocks", "kv_cache_bytes", "max_model_len",
                                                  "swap_space_bytes"})
        if relaid:
            # A fresh cache: every in-flight request is queued for recompute; none is dropped.
            sim.dev.clear()
            sim.host.clear()
            assert sched.kv.pool.num_blocks == new.resolved_num_kv_blocks(LIMITS)
            assert sched.kv.block_size == new.block_size
            assert sched.kv.num_used_blocks == 0
            for s in live_before:
                assert s.status.finished or s.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
        for s in live_before:
            if s.status.finished:  # only a shorter max_model_len may end a request here
                assert s.finish_reason == "length" and s.num_tokens >= sched.max_model_len

    @rule()
    def run_to_completion(self) -> None:
        self.sim.drain()

    @invariant()
    def consistent(self) -> None:
        self.sim.check_invariants()

    def teardown(self) -> None:
        if hasattr(self, "sim") and not self.sim.broken:
            self.sim.drain()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = examples(120, stateful_step_count=40)


# Directed properties ------------------------------------------------------------------------------------------

def make_sim(seed: int = 0, **knobs: Any) -> Sim:
    config = dict(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=48,
                  swap_space_bytes=256)
    config.update(knobs)
    return Sim(EngineConfig.create(LIMITS, **config), random.Random(seed))


def run_all(sim: Sim) -> list[SchedulerOutput]:
    outs = []
    for _ in range(10_000):
        if not sim.sched.num_unfinished:
            break
        outs.append(sim.step())
        sim.check_invariants()
    assert sim.sched.num_unfinished == 0
    return outs


@examples(60)
@given(priorities=st.lists(st.integers(-3, 3), min_size=2, max_size=8), policy=st.sampled_from(["fcfs", "priority"]))
def test_policy_decides_the_order_of_service(priorities: list[int], policy: str) -> None:
    """FCFS serves requests in arrival order whatever their priority; the priority policy serves the lowest
    priority value first, ties in arrival order."""
    sim = make_sim(scheduling_policy=policy, max_num_seqs=1, max_num_batched_tokens=8)
    seqs = [sim.new_seq([1, 2, 3], max_tokens=2, priority=p) for p in priorities]
    for seq in seqs:
        sim.add(seq)
    order: list[Sequence] = []
    for out in run_all(sim):
        order += [item.seq for item in out.scheduled if item.seq not in order]
    expected = sorted(seqs, key=lambda s: (s.priority, s.arrival_order)) if policy == "priority" else seqs
    assert order == expected
    assert all(s.finish_reason == "length" and s.num_output_tokens == 2 for s in seqs)


@examples(60)
@given(budget=st.integers(4, 32), num_decoding=st.integers(1, 3), prompt_len=st.integers(1, 46),
       ratio=st.sampled_from([0.1, 0.5, 1.0]), chunk=st.none() | st.integers(1, 32))
def test_decodes_and_prefill_chunks_share_one_budget(budget: int, num_decoding: int, prompt_len: int,
                                                     ratio: float, chunk: int | None) -> None:
    """Decode tokens are served first; a new prompt gets a chunk of what is left of the step's budget, within
    chunk_size and the prefill share, and no more."""
    chunk = min(chunk, budget) if chunk is not None else None
    sim = make_sim(max_num_seqs=4, max_num_batched_tokens=budget, chunk_size=chunk, prefill_token_ratio=ratio)
    decoding = [sim.new_seq([1, 2], max_tokens=40) for _ in range(num_decoding)]
    for seq in decoding:
        sim.add(seq)
    while any(s.in_prefill for s in decoding):
        sim.step()
    sim.add(sim.new_seq([3] * prompt_len, max_tokens=1))
    out = sim.step()
    assert out.num_decode_tokens == num_decoding
    prefill_cap = max(1, int(budget * ratio))
    assert out.num_prefill_tokens == min(prompt_len, chunk or budget, prefill_cap, budget - num_decoding)
    assert out.num_tokens <= budget


def _pressure_workload(sim: Sim, num: int = 4, prompt_len: int = 6, max_tokens: int = 12) -> list[Sequence]:
    seqs = [sim.new_seq([(i + j) % VOCAB for j in range(prompt_len)], max_tokens) for i in range(num)]
    for seq in seqs:
        sim.add(seq)
    return seqs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_small_pool_finishes_everything(mode: str) -> None:
    """Four requests that need 36 blocks between them share a pool of 12: they are preempted (by swap, copying
    their blocks to the host pool and back; or by recompute), yet every one finishes with all its tokens, no block
    stays used, and swap never computes a token twice while recompute redoes work."""
    sim = make_sim(block_size=2, num_kv_blocks=12, max_model_len=24, max_num_seqs=4, max_num_batched_tokens=32,
                   preemption_mode=mode, swap_space_bytes=64 * 2, enable_prefix_caching=False)
    seqs = _pressure_workload(sim)
    outs = run_all(sim)
    assert sum(o.num_preemptions for o in outs) > 0
    assert all(s.finish_reason == "length" and s.num_output_tokens == 12 for s in seqs)
    computed = sum(o.num_tokens for o in outs)
    needed = sum(s.num_prompt_tokens + s.num_output_tokens - 1 for s in seqs)
    if mode == "swap":
        swapped_out = [h for o in outs for _, h in o.swap_out]
        swapped_in = [h for o in outs for h, _ in o.swap_in]
        assert swapped_out and sorted(swapped_out) == sorted(swapped_in)  # every host copy came back
        assert computed == needed
    else:
        assert not any(o.swap_out or o.swap_in for o in outs)
        assert computed > needed
    assert sim.sched.kv.num_used_blocks == 0
    assert sim.sched.kv.host_pool.num_free == sim.sched.kv.host_pool.num_blocks


def test_preempted_requests_come_back_before_new_ones() -> None:
    """A request preempted for lack of blocks is not overtaken by requests that arrive later and would fit: they
    wait until it runs again (no starvation of preempted requests)."""
    sim = make_sim(block_size=1, num_kv_blocks=10, max_model_len=10, max_num_seqs=4, max_num_batched_tokens=10,
                   enable_prefix_caching=False)
    a, b = (sim.new_seq([1, 2, 3, 0], max_tokens=6) for _ in range(2))
    sim.add(a)
    sim.add(b)
    out = sim.step()
    while not out.num_preemptions:
        out = sim.step()
    assert b.status is SequenceStatus.PREEMPTED and a.status is SequenceStatus.RUNNING
    c = sim.new_seq([3], max_tokens=1)
    sim.add(c)
    first_step: dict[Sequence, int] = {}
    for index, out in enumerate(run_all(sim)):
        for item in out.scheduled:
            first_step.setdefault(item.seq, index)
    assert first_step[b] <= first_step[c], "a new request overtook a preempted one"
    assert all(s.finish_reason == "length" for s in (a, b, c))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_lowering_max_num_seqs_takes_effect_at_the_next_step(mode: str) -> None:
    sim = make_sim(max_num_seqs=6, max_num_batched_tokens=64, preemption_mode=mode)
    seqs = _pressure_workload(sim, num=6, prompt_len=4, max_tokens=10)
    sim.step()
    sim.step()
    assert sim.sched.num_running == 6
    sim.sched.apply_config(sim.sched.config.updated(LIMITS, max_num_seqs=2))
    out = sim.step()
    assert len(out.scheduled) <= 2 and sim.sched.num_running == 2
    assert [s.status for s in seqs[:2]] == [SequenceStatus.RUNNING] * 2  # the oldest keep running
    assert all(s.num_preemptions == 1 for s in seqs[2:])
    outs = run_all(sim)
    assert all(len(o.scheduled) <= 2 for o in outs)
    assert all(s.finish_reason == "length" and s.num_output_tokens == 10 for s in seqs)


@examples(40)
@given(steps_before=st.integers(0, 12), block_size=st.sampled_from([1, 2, 3, 8, 16]),
       pool_factor=st.integers(1, 3), mode=st.sampled_from(["recompute", "swap"]),
       chunk=st.none() | st.integers(1, 16))
def test_relayout_mid_run_loses_no_request(steps_before: int, block_size: int, pool_factor: int, mode: str,
                                           chunk: int | None) -> None:
    """Changing block_size and the pool size in the middle of generation re-lays the cache: in-flight requests are
    recomputed from their tokens so far, and each still ends with all its tokens, the earlier ones unchanged."""
    sim = make_sim(block_size=4, num_kv_blocks=24, max_model_len=32, preemption_mode=mode, swap_space_bytes=64)
    seqs = _pressure_workload(sim, num=6, prompt_len=7, max_tokens=14)
    for _ in range(steps_before):
        sim.step()
    so_far = {s: list(s.output_token_ids) for s in seqs}
    new = sim.sched.config.updated(LIMITS, block_size=block_size, num_kv_blocks=pool_factor * cdiv(32, block_size),
                                   chunk_size=chunk)
    relayout, ended = sim.sched.apply_config(new)
    assert relayout and not ended
    sim.dev.clear()
    sim.host.clear()
    assert sim.sched.kv.block_size == block_size and sim.sched.kv.num_used_blocks == 0
    assert sim.sched.num_unfinished == sum(1 for s in seqs if not s.status.finished)
    sim.check_invariants()
    run_all(sim)
    for seq in seqs:
        assert seq.finish_reason == "length" and seq.num_output_tokens == 14
        assert seq.output_token_ids[:len(so_far[seq])] == so_far[seq]


def test_relayout_recomputes_swapped_requests() -> None:
    """Host copies belong to the old layout: a re-layout while requests are swapped out queues them for recompute
    and hands the whole (new) host pool back; they still finish with all their tokens."""
    sim = make_sim(block_size=2, num_kv_blocks=12, max_model_len=24, max_num_seqs=4, max_num_batched_tokens=32,
                   preemption_mode="swap", swap_space_bytes=128, enable_prefix_caching=False)
    seqs = _pressure_workload(sim)
    while not any(s.status is SequenceStatus.SWAPPED for s in seqs):
        sim.step()
    relayout, _ = sim.sched.apply_config(sim.sched.config.updated(LIMITS, block_size=4, num_kv_blocks=8))
    sim.dev.clear()
    sim.host.clear()
    assert relayout and not any(s.status is SequenceStatus.SWAPPED or s.host_block_table for s in seqs)
    assert sim.sched.kv.host_pool.num_free == sim.sched.kv.host_pool.num_blocks
    sim.check_invariants()
    run_all(sim)
    assert all(s.finish_reason == "length" and s.num_output_tokens == 12 for s in seqs)


def test_shorter_max_model_len_ends_long_requests_and_rejects_stranding_ones() -> None:
    """A max_model_len below a prompt in flight is refused and changes nothing; one that only cuts generation short
    ends the requests already at the new length (finish reason "length") and keeps the others."""
    sim = make_sim(max_model_len=40)
    long_prompt = sim.new_seq([1] * 20, max_tokens=16)
    short = sim.new_seq([2] * 4, max_tokens=16)
    sim.add(long_prompt)
    sim.add(short)
    for _ in range(5):
        sim.step()
    sched = sim.sched
    before = (sched.config, sched.kv, [list(s.block_table) for s in (long_prompt, short)])
    with pytest.raises(ConfigError, match="max_model_len"):
        sched.apply_config(sched.config.updated(LIMITS, max_model_len=16, block_size=8))
    assert before == (sched.config, sched.kv, [list(s.block_table) for s in (long_prompt, short)])
    sim.check_invariants()

    relayout, ended = sched.apply_config(sched.config.updated(LIMITS, max_model_len=24))
    sim.dev.clear()
    assert relayout and ended == [long_prompt] and long_prompt.finish_reason == "length"
    run_all(sim)
    assert short.finish_reason == "length" and short.num_output_tokens == 16


@examples(40)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=10), steps=st.integers(0, 20),
       mode=st.sampled_from(["recompute", "swap"]))
def test_aborting_everything_frees_every_block(lengths: list[int], steps: int, mode: str) -> None:
    sim = make_sim(block_size=2, num_kv_blocks=24, preemption_mode=mode, swap_space_bytes=32)
    seqs = [sim.new_seq([i % VOCAB] * n, max_tokens=16) for i, n in enumerate(lengths)]
    for seq in seqs:
        sim.add(seq)
    for _ in range(steps):
        sim.step()
    for seq in seqs:
        sim.sched.abort(seq.request_id)
    sim.check_invariants()
    assert sim.sched.num_unfinished == 0 and sim.sched.kv.num_used_blocks == 0
    assert sim.sched.kv.host_pool.num_free == sim.sched.kv.host_pool.num_blocks
    assert not sim.sched.schedule().scheduled
    assert {s.finish_reason for s in seqs} <= FINISH_REASONS


def test_prefix_cache_hits_are_counted_and_shared() -> None:
    """Requests that share a long prompt prefix with an earlier one compute only what is new."""
    sim = make_sim(block_size=4, max_model_len=48)
    system = [1, 2, 3, 0] * 8  # 32 tokens, 8 blocks
    first = sim.new_seq(system + [1], max_tokens=2)
    sim.add(first)
    run_all(sim)
    later = [sim.new_seq(system + [2, i % VOCAB], max_tokens=2) for i in range(3)]
    for seq in later:
        sim.add(seq)
    out = sim.step()
    assert out.prefix_hit_tokens == 3 * 32
    assert all(s.num_cached_tokens == 32 for s in later)
    assert sum(item.num_tokens for item in out.scheduled) == 3 * 2
    assert sim.sched.prefix_cache_hits == 3 * 32
    run_all(sim)


@examples(100)
@given(priorities=st.lists(st.integers(-2, 2), max_size=12), removed=st.sets(st.integers(0, 11)),
       readded=st.sets(st.integers(0, 11)), policy=st.sampled_from(["fcfs", "priority"]))
def test_request_queue_pops_in_policy_order(priorities: list[int], removed: set[int], readded: set[int],
                                            policy: str) -> None:
    """Members come out by arrival (FCFS) or by (priority, arrival); a removed one never comes out, one removed
    and pushed again comes out once."""
    queue = RequestQueue(policy)
    seqs = [Sequence(f"q{i}", [1], SamplingParams(), priority=p) for i, p in enumerate(priorities)]
    for seq in seqs:
        queue.push(seq)
    for i in removed & set(range(len(seqs))):
        queue.remove(seqs[i])
    for i in readded & removed & set(range(len(seqs))):
        queue.push(seqs[i])
    members = [s for i, s in enumerate(seqs) if i not in removed or i in readded]
    assert len(queue) == len(members) and all(s in queue for s in members)
    expected = sorted(members, key=lambda s: (s.priority if policy == "priority" else 0, s.arrival_order))
    popped = []
    while len(queue):
        head = queue.peek()
        popped.append(queue.pop())
        assert popped[-1] is head
    assert popped == expected and queue.peek() is None
