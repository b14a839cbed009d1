"""``PeerTransfers`` as a state machine over one block pool: transfers in and out open, finish,
close and expire in any order beside ordinary allocations, and after every step the pool's
invariants hold, the open transfers hold exactly the references the pool counts beyond the
caller's, and a block is findable only under a hash it was received (or computed) for."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.peer_seam import PeerTransfers

HASHES = [bytes([i]) * 8 for i in range(24)]


class TransferMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.pool = BlockPool(16)
        self.peers = PeerTransfers(self.pool, clock=lambda: self.now, expire_s=5.0)
        self.mine: list[int] = []        # blocks the "engine" holds (a request's)
        self.received: set[bytes] = set()  # hashes made findable by a finished receive
        self.computed: set[bytes] = set()  # hashes the engine cached itself
        self.n = 0

    def _name(self) -> str:
        self.n += 1
        return f"t{self.n}"

    @rule(start=st.integers(0, 20), length=st.integers(1, 12))
    def begin_receive(self, start: int, length: int) -> None:
        op = self.peers.begin_receive(self._name(), HASHES[start:start + length], "ray:x")
        if op is not None:
            assert len(op.block_ids) == len(op.keys) <= length
            assert all(self.pool.ref_count(b) == 1 for b in op.block_ids)

    @rule(data=st.data())
    def finish_receive(self, data: st.DataObject) -> None:
        open_in = [t for t in list(self.peers._peer)]
        if not open_in:
            return
        t = data.draw(st.sampled_from(open_in))
        op = self.peers.receive_op(t)
        assert op is not None
        written = data.draw(st.integers(0, len(op.block_ids)))
        self.peers.finish_receive(t, written)
        self.received |= {h for h in op.keys[:written] if self.pool.lookup(h) is not None}

    @rule(start=st.integers(0, 20), length=st.integers(1, 6))
    def send(self, start: int, length: int) -> None:
        t = self._name()
        op = self.peers.begin_send(t, HASHES[start:start + length], "ray:x")
        if op is not None:
            assert [self.pool.lookup(h) for h in op.keys] == op.block_ids
        self.peers.close(t)

    @rule(data=st.data())
    def close_one(self, data: st.DataObject) -> None:
        open_in = list(self.peers._peer)
        if open_in:
            self.peers.close(data.draw(st.sampled_from(open_in)))

    @rule(n=st.integers(1, 4), h=st.integers(0, 23))
    def compute(self, n: int, h: int) -> None:
        if self.pool.num_free >= n:
            blocks = self.pool.allocate(n)
            self.pool.cache(blocks[0], HASHES[h])
            if self.pool.lookup(HASHES[h]) == blocks[0]:
                self.computed.add(HASHES[h])
            self.mine += blocks

    @rule()
    def release_mine(self) -> None:
        self.pool.free(list(reversed(self.mine)))
        self.mine = []

    @rule(dt=st.floats(0.0, 4.0))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.peers.expire()

    @invariant()
    def accounted(self) -> None:
        self.pool.check()
        refs = sum(self.pool.ref_count(b) for b in range(self.pool.num_blocks))
        assert refs == len(self.mine) + self.peers.held_refs()
        for h in HASHES:
            if self.pool.lookup(h) is not None:
                assert h in self.received or h in self.computed

    @invariant()
    def nothing_older_than_expiry(self) -> None:
        assert all(self.now - at <= 5.0 for at in self.peers._opened.values())


TestTransferMachine = TransferMachine.TestCase
TestTransferMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
