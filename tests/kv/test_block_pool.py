"""Block pool: exact ids, LRU reuse, and a hypothesis state machine over random operations."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.hashing import hash_block, root_key

ROOT = root_key("test-model", "bfloat16", 4)


def test_allocate_hands_out_lowest_ids_first_and_free_returns_them():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.check()
    assert pool.num_free == 2 and pool.num_used == 2
    pool.free([1, 0])
    pool.check()
    # 2 and 3 were never used, so they go first; then 1, then 0 (freed in that order).
    assert pool.allocate(4) == [2, 3, 1, 0]
    pool.check()


def test_cached_free_block_is_findable_until_reused():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    h = hash_block(ROOT, [1, 2, 3, 4])
    pool.cache(b, h)
    pool.free([b])
    pool.check()
    assert pool.lookup(h) == b
    assert pool.usage().cached_free == 1 and pool.usage().free_uncached == 1
    pool.allocate(1)  # takes block 1, the never-used one: b stays cached
    assert pool.lookup(h) == b
    pool.allocate(1)  # now b is reused and loses its hash
    assert pool.lookup(h) is None
    pool.check()


def test_touch_revives_a_cached_free_block():
    pool = BlockPool(3)
    [b] = pool.allocate(1)
    pool.cache(b, hash_block(ROOT, [7]))
    pool.free([b])
    pool.touch([b])
    pool.check()
    assert pool.ref_count(b) == 1 and pool.num_free == 2


def test_double_free_and_overallocation_raise():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    with pytest.raises(ValueError):
        BlockPool(0)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/touch/free/cache sequences keep every block accounted for."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8)
        self.held: list[int] = []  # one entry per reference we hold
        self.next_token = 0

    @precondition(lambda self: self.pool.num_free > 0)
    @rule(n=st.integers(min_value=1, max_value=8))
    def allocate(self, n: int) -> None:
        n = min(n, self.pool.num_free)
        self.held.extend(self.pool.allocate(n))

    @precondition(lambda self: bool(self.held))
    @rule(i=st.integers(min_value=0))
    def free_one(self, i: int) -> None:
        self.pool.free([self.held.pop(i % len(self.held))])

    @precondition(lambda self: bool(self.held))
    @rule(i=st.integers(min_value=0))
    def share(self, i: int) -> None:
        b = self.held[i % len(self.held)]
        self.pool.touch([b])
        self.held.append(b)

    @precondition(lambda self: bool(self.held))
    @rule(i=st.integers(min_value=0))
    def cache(self, i: int) -> None:
        self.next_token += 1
        self.pool.cache(self.held[i % len(self.held)], hash_block(ROOT, [self.next_token]))

    @rule(h=st.integers(min_value=1, max_value=50))
    def lookup_points_at_a_block_with_that_hash(self, h: int) -> None:
        digest = hash_block(ROOT, [h])
        b = self.pool.lookup(digest)
        if b is not None:
            assert self.pool.block_hash(b) == digest

    @invariant()
    def accounted(self) -> None:
        self.pool.check()
        assert self.pool.num_used == len(set(self.held))
        assert self.pool.num_free + self.pool.num_used == self.pool.num_blocks
        for b in set(self.held):
            assert self.pool.ref_count(b) == self.held.count(b)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_reset_cache_forgets_cached_free_blocks_but_not_used_ones():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    ha, hb, hc = (hash_block(ROOT, [t]) for t in (1, 2, 3))
    for block, h in ((a, ha), (b, hb), (c, hc)):
        pool.cache(block, h)
    pool.free([b, a])  # a and b cached-free; c still used
    assert pool.num_cached_free == 2
    assert pool.reset_cache() == 2
    pool.check()
    assert pool.lookup(ha) is None and pool.lookup(hb) is None
    assert pool.block_hash(a) is None and pool.block_hash(b) is None
    assert pool.lookup(hc) == c  # a used block keeps its hash: its holder may still share it
    assert pool.usage().cached_free == 0 and pool.usage().free_uncached == 3
    assert pool.reset_cache() == 0  # nothing left to forget
