"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, per-sequence block tables, reference counts,
prefix caching by chained block hashes, and lazy LRU eviction. Pure Python on block ids, so the simulator can
drive it on a virtual clock; the tensors live in `engine.kv_cache`.

Free blocks sit in one LRU-ordered dict. A freed block that holds a full, hashed block of tokens stays in the
hash table ("cached") until it is handed out again, which is when it is evicted. Freed blocks without a hash go
to the front of the LRU so that cached blocks survive as long as possible. Every hot-path operation is O(1)
per block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    # Kept for cached blocks to rule out hash collisions: a hit needs the same tokens after the same parent block.
    token_ids: tuple[int, ...] = ()
    parent_hash: int | None = None


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """A block's hash depends on every token before it, so equal hashes mean equal prefixes."""
    return hash((parent_hash, token_ids))


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the block pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self) -> int:
        """Take the least recently used free block, evicting its cached content if it has any."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
            block.parent_hash = None
        block.ref_count = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """Take one more reference to a block found in the prefix cache."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def free(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed more often than allocated")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent_hash: int | None) -> int | None:
        """The cached block with this hash if it holds `token_ids` right after the block hashed `parent_hash`
        (None: at the start of a sequence); None on a miss or a hash collision."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids or block.parent_hash != parent_hash:
            return None
        return block_id

    def register(self, block_id: int, block_hash: int, token_ids: tuple[int, ...], parent_hash: int | None) -> None:
        """Offer a full block to the prefix cache; an existing entry for the same hash is kept."""
        if block_hash in self._cached:
            return
        block = self.blocks[block_id]
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_hash = parent_hash
        self._cached[block_hash] = block_id

    def drop_free_cached(self) -> int:
        """Forget the cached content of every free block (blocks a sequence holds keep theirs); returns how many."""
        dropped = [(block_hash, block_id) for block_hash, block_id in self._cached.items()
                   if self.blocks[block_id].ref_count == 0]
        for block_hash, block_id in dropped:
            block = self.blocks[block_id]
            del self._cached[block_hash]
            block.block_hash = None
            block.token_ids = ()
            block.parent_hash = None
            self._free.move_to_end(block_id, last=False)  # an empty block is handed out first again
        return len(dropped)

    def reset_prefix_cache(self) -> None:
        for block_id in self._cached.values():
            self.blocks[block_id].block_hash = None
            self.blocks[block_id].token_ids = ()
            self.blocks[block_id].parent_hash = None
        self._cached.clear()


class HostBlockPool:
    """Host-memory blocks that swapped-out sequences are copied into. A stack of free ids: O(1) both ways."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, block_id: int) -> None:
        self._free.append(block_id)


@dataclass
class PrefixMatch:
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class KVCacheManager:
    """Block tables of sequences on top of a BlockPool (and a HostBlockPool for swapping)."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.host_pool = HostBlockPool(num_host_blocks)
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def set_prefix_caching(self, enabled: bool) -> None:
        if not enabled:
            self.pool.reset_prefix_cache()
        self.enable_prefix_caching = enabled

    def drop_free_cached(self) -> int:
        """Empty the prefix cache of every block no sequence holds (so a measurement starts from the same state)."""
        return self.pool.drop_free_cached()

    # Prefix caching ---------------------------------------------------------------------------------------------
    def find_prefix(self, seq: Sequence) -> PrefixMatch:
        """The longest run of cached full blocks at the start of `seq`, leaving at least one token to compute
        (the step needs a last token to produce logits from)."""
        match = PrefixMatch()
        if not self.enable_prefix_caching or seq.num_computed_tokens > 0:
            return match
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        parent: int | None = None
        for i in range(max_blocks):
            tokens = tuple(seq.token_slice(i * bs, (i + 1) * bs))
            block_hash = chain_hash(parent, tokens)
            block_id = self.pool.lookup(block_hash, tokens, parent)
            if block_id is None:
                break
            match.block_ids.append(block_id)
            match.block_hashes.append(block_hash)
            parent = block_hash
        return match

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash the sequence's newly completed blocks and offer them to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(chain_hash(parent, tuple(seq.token_slice(i * bs, (i + 1) * bs))))
        while seq.num_registered_blocks < num_full:
            i = seq.num_registered_blocks
            parent = seq.block_hashes[i - 1] if i else None
            self.pool.register(seq.block_table[i], seq.block_hashes[i], tuple(seq.token_slice(i * bs, (i + 1) * bs)),
                               parent)
            seq.num_registered_blocks += 1

    # Allocation -------------------------------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> int:
        """New blocks `seq` needs for `num_new_tokens` more tokens (after its cached prefix, if given)."""
        num_prefix = prefix.num_blocks if prefix else 0
        tokens = seq.num_computed_tokens + num_prefix * self.block_size + num_new_tokens
        return max(0, -(-tokens // self.block_size) - len(seq.block_table) - num_prefix)

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens of `seq` (after its cached prefix, if given).
        All-or-nothing: on False nothing changed."""
        prefix = prefix or PrefixMatch()
        # Cached blocks that are free right now leave the free list when taken.
        revived = sum(1 for b in prefix.block_ids if self.pool.blocks[b].ref_count == 0)
        num_new = self.blocks_needed(seq, num_new_tokens, prefix)
        if num_new + revived > self.pool.num_free:
            return False
        if prefix.num_blocks:
            for block_id in prefix.block_ids:
                self.pool.touch(block_id)
            seq.block_table.extend(prefix.block_ids)
            seq.block_hashes = list(prefix.block_hashes)
            seq.num_registered_blocks = prefix.num_blocks
            seq.num_computed_tokens = prefix.num_blocks * self.block_size
        for _ in range(num_new):
            seq.block_table.append(self.pool.allocate())
        return True

    def free(self, seq: Sequence) -> None:
        # Free in reverse so that a sequence's tail blocks are evicted before its (more shareable) head.
        for block_id in reversed(seq.block_table):
            self.pool.free(block_id)
        seq.block_table = []
        seq.num_registered_blocks = 0
        for block_id in seq.host_block_table:
            self.host_pool.free(block_id)
        seq.host_block_table = []

    # Swapping ---------------------------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.host_pool.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks to host blocks; returns (device block, host block) copies to make."""
        mapping = []
        for block_id in seq.block_table:
            host_id = self.host_pool.allocate()
            mapping.append((block_id, host_id))
            seq.host_block_table.append(host_id)
        for block_id in reversed(seq.block_table):
            self.pool.free(block_id)
        seq.block_table = []
        seq.num_registered_blocks = 0
        return mapping

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        # A swapped sequence's block table is empty, so this counts the blocks its host copies need too.
        return self.blocks_needed(seq, num_new_tokens) <= self.pool.num_free

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Bring a swapped sequence back with room for `num_new_tokens`; returns (host, device) copies."""
        mapping = []
        for host_id in seq.host_block_table:
            block_id = self.pool.allocate()
            mapping.append((host_id, block_id))
            seq.block_table.append(block_id)
            self.host_pool.free(host_id)
        seq.host_block_table = []
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self.pool.allocate())
        return mapping
