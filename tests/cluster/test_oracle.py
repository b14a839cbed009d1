"""The offline oracle replays each replica's event log up to the moment of each decision."""

from __future__ import annotations

from kvserve.cluster.feed import ReplicaFeed
from kvserve.cluster.oracle import replay_oracle
from kvserve.cluster.records import Decision
from kvserve.cluster.replica_set import DecisionRecord
from kvserve.kv.events import BlockRemoved, BlockStored

H = [bytes([i]) * 4 for i in range(6)]
BS = 4


def test_the_oracle_sees_each_replicas_cache_as_it_was_at_each_decision() -> None:
    a, b = ReplicaFeed(), ReplicaFeed()
    for i, h in enumerate(H[:3]):
        a.on_pool_event(BlockStored(0, h, i))
    # decision 1, at a@3 b@0: 13 tokens → 3 full blocks, at most (13-1)//4 = 3 reusable; sent to b
    d1 = DecisionRecord(tuple(H[:3]), Decision("b", "round_robin"), {"a": a.seq, "b": b.seq}, 13)
    for i, h in enumerate(H[:2]):
        b.on_pool_event(BlockStored(0, h, i))
    a.on_pool_event(BlockRemoved(0, H[0], 0))  # a loses the first block: its prefix is gone
    # decision 2, at a@4 b@2: 12 tokens → 3 full blocks, at most (12-1)//4 = 2 reusable; sent to a
    d2 = DecisionRecord(tuple(H[:3]), Decision("a", "round_robin"), {"a": a.seq, "b": b.seq}, 12)
    session_turn = DecisionRecord((), Decision("a", "sticky"), {"a": a.seq, "b": b.seq}, 0)
    r = replay_oracle([d1, d2, session_turn], {"a": a.all_events(), "b": b.all_events()}, BS)
    assert (r.blocks, r.achieved, r.oracle) == (5, 0, 5)  # d1: b held 0, a held 3; d2: a held 0, b held 2
    assert r.ratio == 0.0 and r.oracle_rate == 1.0
    good = [DecisionRecord(d1.block_hashes, Decision("a", "prefix"), d1.seqs, 13),
            DecisionRecord(d2.block_hashes, Decision("b", "prefix"), d2.seqs, 12)]
    assert replay_oracle(good, {"a": a.all_events(), "b": b.all_events()}, BS).ratio == 1.0
