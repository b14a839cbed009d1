"""The router's pure logic: policies over a block index fed by replica feeds (no Ray)."""

from __future__ import annotations

import pytest

from kvserve.cluster.feed import ReplicaFeed
from kvserve.cluster.index import BlockIndex, IndexGap
from kvserve.cluster.records import ReplicaEvent, ReplicaLoad, ReplicaPoll, RouteQuery
from kvserve.cluster.router import KVRouter, NoReplica, RoundRobin, RouterConfig, SessionHash
from kvserve.kv.events import BlockRemoved, BlockStored

H = [bytes([i]) * 4 for i in range(8)]
IDLE = ReplicaLoad(0, 0, 10, 10)


def index_with(**held: dict[str, list[bytes]]) -> BlockIndex:
    """An index built the way the router builds it: from each replica's feed."""
    idx = BlockIndex()
    for replica, tiers in held.items():
        feed = ReplicaFeed()
        for tier, hashes in tiers.items():
            for i, h in enumerate(hashes):
                if tier == "pool":
                    feed.on_pool_event(BlockStored(0, h, i))
                else:
                    feed.tier_change("stored", tier, h)
        idx.apply(replica, feed.poll(-1))
    return idx


def test_the_longest_prefix_wins_and_stops_at_the_first_missing_block() -> None:
    idx = index_with(a={"pool": H[:2]}, b={"pool": [H[0], H[1], H[2], H[4]]})
    assert idx.prefix("b", H[:5]) == ("pool", "pool", "pool")
    d = KVRouter(idx).choose(RouteQuery(tuple(H[:5])), {"a": IDLE, "b": IDLE})
    assert (d.replica, d.reason, d.matched_blocks) == ("b", "prefix", 3)


def test_a_pool_copy_beats_the_same_prefix_on_disk() -> None:
    idx = index_with(a={"disk": H[:4]}, b={"pool": H[:4]})
    assert KVRouter(idx).choose(RouteQuery(tuple(H[:4])), {"a": IDLE, "b": IDLE}).replica == "b"
    # but a longer prefix on disk beats a short one in the pool: 6 x 0.5 > 2 x 1.0
    idx = index_with(a={"disk": H[:6]}, b={"pool": H[:2]})
    assert KVRouter(idx).choose(RouteQuery(tuple(H[:6])), {"a": IDLE, "b": IDLE}).replica == "a"


def test_a_replica_holding_the_prefix_in_the_host_tier_after_its_pool_evicted_it_still_attracts() -> None:
    feed, idx = ReplicaFeed(), BlockIndex()
    idx.apply("a", feed.poll(-1))
    for i, h in enumerate(H[:3]):
        feed.on_pool_event(BlockStored(0, h, i))
        feed.tier_change("stored", "host", h)
    for i, h in enumerate(H[:3]):
        feed.on_pool_event(BlockRemoved(0, h, i))
    idx.apply("a", feed.poll(idx.seq["a"]))
    assert idx.prefix("a", H[:3]) == ("host",) * 3
    d = KVRouter(idx).choose(RouteQuery(tuple(H[:3])), {"a": IDLE, "b": IDLE})
    assert (d.replica, d.reason) == ("a", "prefix")


def test_load_outweighs_a_short_prefix() -> None:
    idx = index_with(a={"pool": H[:1]})
    busy = ReplicaLoad(num_running=4, num_waiting=0, blocks_free=10, blocks_total=10)
    d = KVRouter(idx, RouterConfig(load_weight=1.0)).choose(RouteQuery(tuple(H[:4])), {"a": busy, "b": IDLE})
    assert d.replica == "b"


def test_sessions_stick_unless_their_replica_is_overloaded_or_gone() -> None:
    router = KVRouter(BlockIndex(), RouterConfig(overload_waiting=2))
    first = router.choose(RouteQuery((), session_id="s"), {"a": ReplicaLoad(1, 0), "b": IDLE})
    assert (first.replica, first.reason) == ("b", "least_loaded")
    again = router.choose(RouteQuery((), session_id="s"), {"a": IDLE, "b": ReplicaLoad(3, 1)})
    assert (again.replica, again.reason) == ("b", "sticky")
    over = router.choose(RouteQuery((), session_id="s"), {"a": IDLE, "b": ReplicaLoad(3, 2)})
    assert (over.replica, over.reason) == ("a", "least_loaded")
    router.forget_replica("a")
    assert router.choose(RouteQuery((), session_id="s"), {"b": IDLE}).reason == "least_loaded"
    assert router.decisions == {"least_loaded": 3, "sticky": 1}


def test_no_live_replica_is_an_error_not_a_guess() -> None:
    for policy in (KVRouter(BlockIndex()), RoundRobin(), SessionHash()):
        with pytest.raises(NoReplica):
            policy.choose(RouteQuery(()), {})


def test_round_robin_cycles_and_session_hash_is_stable() -> None:
    rr = RoundRobin()
    loads = {"a": IDLE, "b": IDLE}
    assert [rr.choose(RouteQuery(()), loads).replica for _ in range(4)] == ["a", "b", "a", "b"]
    sh = SessionHash()
    picks = {sh.choose(RouteQuery((), routing_key=f"conv-{i}"), loads).replica for i in range(20)}
    assert picks == {"a", "b"}
    assert len({sh.choose(RouteQuery((), routing_key="conv-3"), loads).replica for _ in range(5)}) == 1


def test_the_feed_emits_only_real_changes() -> None:
    feed = ReplicaFeed()
    feed.on_pool_event(BlockStored(1, H[0], 5))
    feed.on_pool_event(BlockStored(2, H[0], 6))   # a second copy: the hash was already findable
    feed.on_pool_event(BlockRemoved(3, H[0], 6))  # not the block that carries it: nothing changes
    assert [e.kind for e in feed.poll(0).events] == ["stored"]
    feed.on_pool_event(BlockRemoved(4, H[0], 5))
    assert [(e.seq, e.kind) for e in feed.poll(0).events] == [(1, "stored"), (2, "removed")]


def test_a_gap_in_the_events_is_refused_and_a_dropped_log_answers_with_a_snapshot() -> None:
    idx = BlockIndex()
    idx.apply("a", ReplicaPoll(0, snapshot={}))
    with pytest.raises(IndexGap):
        idx.apply("a", ReplicaPoll(2, events=(ReplicaEvent(2, "stored", "pool", H[0]),)))
    assert idx.held("a") == {} and idx.seq["a"] == 0
    feed = ReplicaFeed(maxlen=2)
    for i, h in enumerate(H[:4]):
        feed.on_pool_event(BlockStored(0, h, i))
    poll = feed.poll(0)
    assert poll.snapshot == {"pool": tuple(sorted(H[:4]))}
    idx.apply("a", poll)
    assert idx.held("a") == {"pool": frozenset(H[:4])}
