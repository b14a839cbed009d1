"""The pool of KV blocks: ref counts, a free list in LRU order, and the hash → block map.

Plain Python over block ids; the tensors live in the runner's storage.

Invariants (``check()`` asserts them; the KV tests call it after every mutation):
  * every block id in ``0..num_blocks-1`` is either *used* (ref count > 0) or in the free queue
    (ref count 0), never both: ``num_free + num_used == num_blocks``;
  * a free block that still carries a hash is *cached-free*: findable by that hash until it is
    handed out again; ``num_free == num_free_uncached + num_cached_free``;
  * the free queue is in the eviction policy's order (``kvserve.kv.eviction``; LRU by default:
    blocks freed longest ago are reused first);
  * every change to the hash map is announced as a cache event (``kvserve.kv.events``), in order:
    replaying the events rebuilds the map exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv.events import BlockRemoved, BlockStored, BlockTouched, CacheEvent, Subscriber
from kvserve.kv.eviction import EvictionPolicy, make_policy
from kvserve.kv.hashing import BlockHash


@dataclass(frozen=True)
class PoolUsage:
    total: int
    used: int
    cached_free: int
    free_uncached: int

    @property
    def usage_ratio(self) -> float:
        return self.used / self.total


class BlockPool:
    """Blocks ``0..num_blocks-1`` with reference counts."""

    def __init__(self, num_blocks: int, eviction: str = "lru", tier: str = "pool") -> None:
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tier = tier
        self._ref = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._free: EvictionPolicy = make_policy(eviction, list(range(num_blocks)))
        self._cached: dict[BlockHash, int] = {}
        self._subscribers: list[Subscriber] = []
        self._seq = 0

    # -- events ------------------------------------------------------------------------------
    def subscribe(self, subscriber: Subscriber) -> None:
        """Call ``subscriber`` with every cache event from now on, in order."""
        self._subscribers.append(subscriber)

    def snapshot(self) -> tuple[int, dict[BlockHash, int]]:
        """The hash → block map and the sequence number of the last event it includes."""
        return self._seq, dict(self._cached)

    def _emit(self, kind: type[CacheEvent], block_hash: BlockHash, block_id: int) -> None:
        self._seq += 1  # counted even unobserved, so a later subscriber's snapshot numbers line up
        if not self._subscribers:
            return
        event = kind(self._seq, block_hash, block_id, self.tier)
        for sub in self._subscribers:
            sub(event)

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (uncached, or cached-free and evictable)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self._free if self._hash_of[b] is not None)

    def usage(self) -> PoolUsage:
        cached_free = self.num_cached_free
        return PoolUsage(self.num_blocks, self.num_used, cached_free, self.num_free - cached_free)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash_of[block_id]

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding this hash, used or cached-free, or None."""
        return self._cached.get(block_hash)

    # -- mutations ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` blocks, least recently freed first; a cached-free block loses its hash."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        out: list[int] = []
        for _ in range(n):
            block = self._free.pop()
            self._evict_hash(block)
            self._ref[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit or a shared fork)."""
        for b in blocks:
            if self._ref[b] == 0:
                self._free.remove(b)
            self._ref[b] += 1
            h = self._hash_of[b]
            if h is not None:
                self._emit(BlockTouched, h, b)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference on each block. A block whose count reaches 0 goes to the back of the
        free queue (most recently used); callers pass a sequence's blocks tail first so that its
        later blocks, least likely to be shared, are evicted before its earlier ones."""
        for b in blocks:
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than it was taken")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.push(b)

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Make a full, used block findable by its hash. If another block already holds the
        same hash the first one stays the canonical copy."""
        if self._ref[block_id] <= 0:
            raise RuntimeError(f"only a used block can be cached (block {block_id})")
        if self._hash_of[block_id] is not None or block_hash in self._cached:
            return
        self._hash_of[block_id] = block_hash
        self._cached[block_hash] = block_id
        self._emit(BlockStored, block_hash, block_id)

    def reset_cache(self) -> int:
        """Forget every cached-free block's hash (e.g. after weights change). Returns how many."""
        n = 0
        for b in list(self._free):
            if self._hash_of[b] is not None:
                self._evict_hash(b)
                n += 1
        return n

    def _evict_hash(self, block: int) -> None:
        h = self._hash_of[block]
        if h is not None:
            self._hash_of[block] = None
            if self._cached.get(h) == block:
                del self._cached[h]
                self._emit(BlockRemoved, h, block)

    # -- checking ----------------------------------------------------------------------------
    def check(self) -> None:
        """Assert every invariant in the module docstring."""
        assert len(self._free) + sum(1 for r in self._ref if r > 0) == self.num_blocks, "blocks lost"
        for b in range(self.num_blocks):
            assert self._ref[b] >= 0, f"negative ref count on block {b}"
            assert (self._ref[b] == 0) == (b in self._free), f"block {b} free-list/ref mismatch"
        for h, b in self._cached.items():
            assert self._hash_of[b] == h, f"hash map points at block {b} which holds another hash"
        assert sum(1 for h in self._hash_of if h is not None) == len(self._cached), "stray hashes"
