"""The router's index as a state machine: random pool and tier changes on two replicas, polls
at random moments, router restarts, and a log small enough to overflow. After every poll the
index holds exactly what each replica's feed holds."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvserve.cluster.feed import ReplicaFeed
from kvserve.cluster.index import BlockIndex
from kvserve.kv.events import BlockRemoved, BlockStored

REPLICAS = ("a", "b")
HASHES = st.sampled_from([bytes([i]) * 2 for i in range(6)])
BLOCKS = st.integers(0, 3)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.feeds = {r: ReplicaFeed(maxlen=5) for r in REPLICAS}
        self.index = BlockIndex()
        self.polled: set[str] = set()
        self.pool: dict[str, dict[int, bytes]] = {r: {} for r in REPLICAS}  # block → hash, like the pool

    @rule(r=st.sampled_from(REPLICAS), block=BLOCKS, h=HASHES)
    def store_in_pool(self, r: str, block: int, h: bytes) -> None:
        old = self.pool[r].get(block)
        if old is not None:  # the pool reuses the block: its old hash goes first
            self.feeds[r].on_pool_event(BlockRemoved(0, old, block))
            del self.pool[r][block]
        if h in self.pool[r].values():  # BlockPool.cache: the first copy stays canonical, no event
            return
        self.pool[r][block] = h
        self.feeds[r].on_pool_event(BlockStored(0, h, block))

    @rule(r=st.sampled_from(REPLICAS), block=BLOCKS)
    def evict_from_pool(self, r: str, block: int) -> None:
        h = self.pool[r].pop(block, None)
        if h is not None:
            self.feeds[r].on_pool_event(BlockRemoved(0, h, block))

    @rule(r=st.sampled_from(REPLICAS), tier=st.sampled_from(["host", "disk", "remote"]), h=HASHES,
          kind=st.sampled_from(["stored", "removed"]))
    def tier_change(self, r: str, tier: str, h: bytes, kind: str) -> None:
        self.feeds[r].tier_change(kind, tier, h)

    @rule(r=st.sampled_from(REPLICAS))
    def poll(self, r: str) -> None:
        self.index.apply(r, self.feeds[r].poll(self.index.seq.get(r, -1)))
        self.polled.add(r)

    @rule()
    def restart_router(self) -> None:
        self.index = BlockIndex()
        for r in sorted(self.polled):
            self.index.apply(r, self.feeds[r].poll(-1))

    @rule(r=st.sampled_from(REPLICAS))
    def replica_dies(self, r: str) -> None:
        self.index.drop(r)
        self.polled.discard(r)

    @invariant()
    def polled_replicas_match_their_feeds(self) -> None:
        for r in REPLICAS:
            if r in self.polled and self.index.seq[r] == self.feeds[r].seq:
                want = {t: s for t, s in self.feeds[r].held().items() if s}
                assert self.index.held(r) == want
            elif r not in self.polled:
                assert self.index.held(r) == {}

    @invariant()
    def the_feed_pool_is_what_the_pool_holds(self) -> None:
        for r in REPLICAS:
            assert self.feeds[r].held()["pool"] == set(self.pool[r].values())


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestIndexMachine = IndexMachine.TestCase
