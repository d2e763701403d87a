"""Property tests of the paged KV cache's bookkeeping (torch-free): the block pool's reference counts and lazy LRU
eviction, prefix caching by chained hashes (with its collision check), swapping to the host pool."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import engine.block_manager as block_manager
from engine.block_manager import BlockPool, HostBlockPool, KVCacheManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def examples(n: int, **more: Any) -> settings:
    """Hypothesis settings for these tests: n examples, no deadline and no speed health check (the machines that
    run them are shared and busy)."""
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow], **more)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_seq(tokens: list[int], name: str = "r") -> Sequence:
    return Sequence(name, list(tokens), PARAMS)


def prefill(kv: KVCacheManager, seq: Sequence) -> int:
    """Admit `seq` the way the scheduler does (cached prefix first) and compute its whole prompt; returns the
    number of prompt tokens served from the prefix cache."""
    prefix = kv.find_prefix(seq)
    cached = prefix.num_blocks * kv.block_size
    assert kv.allocate(seq, seq.num_tokens - cached, prefix)
    seq.num_computed_tokens = seq.num_tokens
    kv.register_full_blocks(seq)
    return cached


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# The block pool against a model of its documented behaviour -----------------------------------------------------

class BlockPoolMachine(RuleBasedStateMachine):
    """Reference counts never go negative, used + free = total, and eviction is lazy LRU: a freed block that holds
    a cached block of tokens stays findable until it is handed out again; allocation hands out blocks without cached
    content first (the most recently freed of them first), then cached ones, least recently freed first."""

    @initialize(num_blocks=st.integers(1, 8))
    def setup(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, block_size=2)
        self.free_order = list(range(num_blocks))  # expected free list, next to be handed out first
        self.refs = [0] * num_blocks
        self.held: list[int] = []  # the references this test holds, one entry per reference
        self.cached: dict[int, tuple[int, tuple[int, ...], int | None]] = {}  # hash -> (block, tokens, parent)

    def _is_cached(self, block_id: int) -> bool:
        return any(entry[0] == block_id for entry in self.cached.values())

    @precondition(lambda self: self.free_order)
    @rule()
    def allocate(self) -> None:
        block_id = self.pool.allocate()
        assert block_id == self.free_order.pop(0)
        self.cached = {h: e for h, e in self.cached.items() if e[0] != block_id}  # evicted now, not before
        self.refs[block_id] = 1
        self.held.append(block_id)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 50))
    def free(self, index: int) -> None:
        block_id = self.held.pop(index % len(self.held))
        self.pool.free(block_id)
        self.refs[block_id] -= 1
        if self.refs[block_id] == 0:
            if self._is_cached(block_id):
                self.free_order.append(block_id)
            else:
                self.free_order.insert(0, block_id)

    @rule(block_id=st.integers(0, 7))
    def free_unreferenced_block_is_refused(self, block_id: int) -> None:
        assume(block_id < self.pool.num_blocks and self.refs[block_id] == 0)
        num_free = self.pool.num_free
        with pytest.raises(RuntimeError):
            self.pool.free(block_id)
        assert self.pool.num_free == num_free and self.pool.blocks[block_id].ref_count == 0

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 50), block_hash=st.integers(0, 5), tokens=st.tuples(st.integers(0, 2)),
          parent=st.none() | st.integers(0, 5))
    def register(self, index: int, block_hash: int, tokens: tuple[int, ...], parent: int | None) -> None:
        block_id = self.held[index % len(self.held)]
        assume(not self._is_cached(block_id))  # a block is offered once per allocation
        self.pool.register(block_id, block_hash, tokens, parent)
        self.cached.setdefault(block_hash, (block_id, tokens, parent))  # the first entry for a hash is kept

    @rule(block_hash=st.integers(0, 5), tokens=st.tuples(st.integers(0, 2)), parent=st.none() | st.integers(0, 5))
    def lookup(self, block_hash: int, tokens: tuple[int, ...], parent: int | None) -> None:
        entry = self.cached.get(block_hash)
        expected = entry[0] if entry is not None and entry[1:] == (tokens, parent) else None
        assert self.pool.lookup(block_hash, tokens, parent) == expected

    @precondition(lambda self: self.cached)
    @rule(data=st.data())
    def touch_cached(self, data: st.DataObject) -> None:
        block_hash = data.draw(st.sampled_from(sorted(self.cached)))
        block_id, tokens, parent = self.cached[block_hash]
        assert self.pool.lookup(block_hash, tokens, parent) == block_id
        self.pool.touch(block_id)
        if self.refs[block_id] == 0:
            self.free_order.remove(block_id)  # revived: it leaves the free list
        self.refs[block_id] += 1
        self.held.append(block_id)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self.cached.clear()

    @invariant()
    def accounting(self) -> None:
        pool = self.pool
        assert pool.num_used + pool.num_free == pool.num_blocks
        assert pool.num_free == len(self.free_order)
        assert pool.num_cached == len(self.cached)
        for block in pool.blocks:
            assert block.ref_count >= 0
            assert block.ref_count == self.refs[block.block_id]
        assert pool.num_used == sum(1 for r in self.refs if r > 0)


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = examples(150, stateful_step_count=40)


def test_allocate_and_free_are_o1() -> None:
    """Allocating and freeing cost the same per block in a pool of 2,000 and of 200,000 blocks (a scan of the
    free list would make the large pool ~100x slower)."""

    def per_op(num_blocks: int) -> float:
        pool = BlockPool(num_blocks, block_size=16)
        for i in range(0, num_blocks, 2):  # half the pool cached, as in a warm server
            pool.register(i, i, (i,), None)
        held = [pool.allocate() for _ in range(num_blocks // 2)]
        best = float("inf")
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(2000):
                b = pool.allocate()
                pool.free(b)
                pool.free(held[-1])
                held[-1] = pool.allocate()
            best = min(best, time.perf_counter() - start)
        return best

    small, large = per_op(2_000), per_op(200_000)
    assert large < 10 * small, f"{large:.4f}s vs {small:.4f}s"


# Prefix caching ---------------------------------------------------------------------------------------------------

@examples(150)
@given(block_size=st.sampled_from([1, 2, 3, 4, 16]), shared=st.lists(st.integers(0, 3), min_size=1, max_size=40),
       tail_a=st.lists(st.integers(0, 3), max_size=8), tail_b=st.lists(st.integers(0, 3), max_size=8),
       a_done=st.booleans(), enabled=st.booleans())
def test_requests_sharing_a_prefix_get_hits(block_size: int, shared: list[int], tail_a: list[int],
                                            tail_b: list[int], a_done: bool, enabled: bool) -> None:
    """B reuses exactly the full blocks of its longest common prefix with A (leaving at least one token to
    compute), whether A still runs or has finished; those blocks are shared, not copied."""
    kv = KVCacheManager(num_blocks=64, block_size=block_size, enable_prefix_caching=enabled)
    a, b = make_seq(shared + tail_a, "a"), make_seq(shared + tail_b, "b")
    assert prefill(kv, a) == 0
    a_blocks = list(a.block_table)
    if a_done:
        kv.free(a)
        assert kv.num_used_blocks == 0
    expected_blocks = min(common_prefix(a.all_token_ids, b.all_token_ids), b.num_tokens - 1) // block_size
    if not enabled:
        expected_blocks = 0
    cached = prefill(kv, b)
    assert cached == expected_blocks * block_size
    assert b.block_table[:expected_blocks] == a_blocks[:expected_blocks]
    if not a_done:  # blocks A still holds are never handed to B as fresh ones
        assert not set(b.block_table[expected_blocks:]) & set(a_blocks)
    for block_id in b.block_table[:expected_blocks]:
        assert kv.pool.blocks[block_id].ref_count == (1 if a_done else 2)
    kv.free(b)
    if not a_done:
        kv.free(a)
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 64


@examples(100)
@given(block_size=st.sampled_from([1, 2, 4]), num_full=st.integers(1, 6), extra_blocks=st.integers(1, 6))
def test_lazy_lru_eviction(block_size: int, num_full: int, extra_blocks: int) -> None:
    """A finished request's cached blocks stay hittable while other requests only need blocks without cached
    content; once those run out the least recently freed cached block goes first (a sequence's tail before its
    head), and a block handed out again is no longer a hit."""
    num_blocks = num_full + extra_blocks
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    prompt = [i % 3 + 1 for i in range(num_full * block_size)]
    a = make_seq(prompt + [0] * (block_size > 1), "a")  # num_full full blocks (then a partial, uncached one)
    prefill(kv, a)
    kv.free(a)
    assert kv.num_used_blocks == 0 and kv.pool.num_cached == num_full

    # Another request takes every block without cached content: the cached ones survive.
    other = make_seq([9] * ((num_blocks - num_full + 1) * block_size), "other")
    assert kv.allocate(other, extra_blocks * block_size)
    assert kv.num_free_blocks == num_full and kv.pool.num_cached == num_full
    probe = make_seq(prompt + [5], "probe")
    assert kv.find_prefix(probe).num_blocks == num_full

    # One more block for it evicts exactly one cached block: A's last, so the head of the prompt still hits.
    assert kv.allocate(other, (extra_blocks + 1) * block_size)
    assert kv.pool.num_cached == num_full - 1
    assert kv.find_prefix(probe).num_blocks == num_full - 1
    kv.free(other)
    assert kv.num_used_blocks == 0


def test_hash_collisions_never_give_wrong_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a hash function under which every block collides, a block is still only reused for the same tokens at
    the same place after the same prefix; other lookups miss instead of handing out someone else's KV."""
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: 42)
    kv = KVCacheManager(num_blocks=32, block_size=2)
    a = make_seq([1, 2, 3, 4, 5], "a")
    prefill(kv, a)
    assert kv.pool.num_cached == 1  # A's first block owns the one hash

    # Different tokens, same (colliding) hash: no hit.
    assert kv.find_prefix(make_seq([7, 8, 3, 4, 5])).num_blocks == 0
    # A's first block holds tokens 1, 2 at positions 0-1; the same tokens later in a prompt are not a hit.
    c = make_seq([1, 2, 1, 2, 1, 2, 9], "c")
    match = kv.find_prefix(c)
    assert match.block_ids == [a.block_table[0]]
    assert prefill(kv, c) == 2
    assert len(set(c.block_table)) == len(c.block_table), "one block used at two places of a sequence"
    # The genuine prefix still hits.
    assert kv.find_prefix(make_seq([1, 2, 9, 9, 9])).block_ids == [a.block_table[0]]


def test_token_comparison_rejects_a_colliding_block() -> None:
    """Even when the hash table maps a hash to a block, a lookup with other tokens or another parent misses."""
    pool = BlockPool(4, block_size=2)
    block = pool.allocate()
    pool.register(block, 123, (1, 2), None)
    assert pool.lookup(123, (1, 2), None) == block
    assert pool.lookup(123, (1, 3), None) is None
    assert pool.lookup(123, (1, 2), 7) is None
    assert pool.lookup(124, (1, 2), None) is None


# Allocation, freeing and swapping ---------------------------------------------------------------------------------

@examples(100)
@given(block_size=st.sampled_from([1, 2, 4, 8]), num_blocks=st.integers(1, 12), first=st.integers(1, 40),
       more=st.integers(1, 40))
def test_allocate_is_all_or_nothing(block_size: int, num_blocks: int, first: int, more: int) -> None:
    """A sequence gets exactly the blocks its tokens need, or, when the pool is short, nothing changes."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    seq = make_seq(list(range(first + more)))
    ok = kv.allocate(seq, first)
    assert ok == (cdiv(first, block_size) <= num_blocks)
    if not ok:
        assert seq.block_table == [] and kv.num_free_blocks == num_blocks
        return
    seq.num_computed_tokens = first
    table, free = list(seq.block_table), kv.num_free_blocks
    ok = kv.allocate(seq, more)
    assert ok == (cdiv(first + more, block_size) <= num_blocks)
    if ok:
        assert seq.block_table[:len(table)] == table and len(seq.block_table) == cdiv(first + more, block_size)
        assert len(set(seq.block_table)) == len(seq.block_table)
    else:
        assert seq.block_table == table and kv.num_free_blocks == free
    kv.free(seq)
    assert kv.num_used_blocks == 0 and seq.block_table == []


@examples(100)
@given(block_size=st.sampled_from([1, 2, 4]), lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4),
       host_blocks=st.integers(0, 30), shared=st.booleans())
def test_swap_out_and_in_round_trip(block_size: int, lengths: list[int], host_blocks: int, shared: bool) -> None:
    """Swapping out moves a sequence's blocks to the host pool (device blocks freed, one host block each);
    swapping in brings every host block back (the host pool is whole again) onto device blocks with room for the
    next tokens."""
    kv = KVCacheManager(num_blocks=256, block_size=block_size, num_host_blocks=host_blocks)
    seqs = [make_seq(([1] * 20 if shared else []) + [i] * n, f"s{i}") for i, n in enumerate(lengths)]
    for seq in seqs:
        prefill(kv, seq)
    swapped = []
    for seq in seqs:
        tables = [list(s.block_table) for s in seqs]
        used = kv.num_used_blocks
        if not kv.can_swap_out(seq):
            assert len(seq.block_table) > kv.host_pool.num_free
            continue
        host_free = kv.host_pool.num_free
        own = [b for b in seq.block_table if kv.pool.blocks[b].ref_count == 1]
        mapping = kv.swap_out(seq)
        assert [d for d, _ in mapping] == tables[seqs.index(seq)]
        assert [h for _, h in mapping] == seq.host_block_table and seq.block_table == []
        assert kv.host_pool.num_free == host_free - len(mapping)
        assert kv.num_used_blocks == used - len(own)
        swapped.append(seq)
    for seq in swapped:
        host_ids = list(seq.host_block_table)
        assert kv.can_swap_in(seq, 1)
        mapping = kv.swap_in(seq, 1)
        assert [h for h, _ in mapping] == host_ids and seq.host_block_table == []
        assert seq.block_table[:len(mapping)] == [d for _, d in mapping]
        assert len(seq.block_table) == cdiv(seq.num_computed_tokens + 1, block_size)
    assert kv.host_pool.num_free == host_blocks
    for seq in seqs:
        kv.free(seq)
    assert kv.num_used_blocks == 0


def test_free_returns_host_blocks_of_a_swapped_sequence() -> None:
    """Aborting a swapped-out request returns its host blocks."""
    kv = KVCacheManager(num_blocks=8, block_size=2, num_host_blocks=4)
    seq = make_seq([1, 2, 3, 4, 5])
    prefill(kv, seq)
    kv.swap_out(seq)
    assert kv.host_pool.num_free == 1 and kv.num_used_blocks == 0
    kv.free(seq)
    assert kv.host_pool.num_free == 4 and seq.host_block_table == []


def test_host_pool_hands_back_what_it_got() -> None:
    host = HostBlockPool(3)
    ids = [host.allocate() for _ in range(3)]
    assert sorted(ids) == [0, 1, 2] and host.num_free == 0
    for i in ids:
        host.free(i)
    assert host.num_free == 3
