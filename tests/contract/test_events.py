"""Cache events: replaying the pool's log rebuilds its hash map exactly, and every stored block is
removed or still live at the end of a random workload."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.events import BlockRemoved, BlockStored, BlockTouched, EventLog, replay
from kvserve.kv.eviction import LRUPolicy, make_policy
from kvserve.kv.hashing import hash_block, root_key

ROOT = root_key("events-test", "bfloat16", 4)
OPS = st.lists(st.tuples(st.sampled_from(["alloc", "cache", "free", "touch", "reset"]), st.integers(0, 50)),
               max_size=120)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_replaying_the_log_rebuilds_the_hash_map(ops: list[tuple[str, int]]) -> None:
    pool = BlockPool(8)
    log = EventLog(maxlen=None)
    pool.subscribe(log)
    held: list[int] = []
    for op, x in ops:
        if op == "alloc" and pool.num_free:
            held += pool.allocate(1)
        elif op == "cache" and held:
            pool.cache(held[x % len(held)], hash_block(ROOT, [x]))
        elif op == "free" and held:
            pool.free([held.pop(x % len(held))])
        elif op == "touch":
            h = hash_block(ROOT, [x])
            b = pool.lookup(h)
            if b is not None:
                pool.touch([b])
                held.append(b)
        elif op == "reset":
            pool.reset_cache()
        pool.check()
        seq, snap = pool.snapshot()
        assert replay(log.all()) == snap
        assert not log.all() or log.all()[-1].seq <= seq
    events = log.all()
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    stored = {(e.block_hash, e.block_id) for e in events if isinstance(e, BlockStored)}
    removed = {(e.block_hash, e.block_id) for e in events if isinstance(e, BlockRemoved)}
    live = set(pool.snapshot()[1].items())
    assert live <= stored <= removed | live  # stored once: removed since, or still live


def test_a_late_subscriber_uses_a_snapshot_plus_the_events_after_it() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, hash_block(ROOT, [1]))
    seq, snap = pool.snapshot()
    log = EventLog(maxlen=2)
    pool.subscribe(log)
    pool.cache(b, hash_block(ROOT, [2]))
    pool.free([a, b])
    pool.touch([a])
    events = log.since(seq)
    assert [type(e) for e in events] == [BlockStored, BlockTouched]
    assert replay(events, snap) == pool.snapshot()[1] == {hash_block(ROOT, [1]): a, hash_block(ROOT, [2]): b}
    pool.touch([b])  # a third event: the 2-event log drops the oldest one after the snapshot
    try:
        log.since(seq)
    except LookupError:
        pass
    else:
        raise AssertionError("a log that dropped events must say so, not return a partial list")


def test_eviction_order_comes_from_the_policy() -> None:
    assert isinstance(make_policy("lru", [0, 1]), LRUPolicy)
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.free([blocks[2], blocks[0], blocks[1]])
    assert pool.allocate(3) == [blocks[2], blocks[0], blocks[1]]  # least recently freed first
