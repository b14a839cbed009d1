"""The bookkeeping half of moving blocks between engines (a prefill/decode split, a session that
moves off a busy replica). Block ids and hashes only; the bytes go through the runner's peers.

Receiving (the decode side)::

    begin_receive(t, hashes) → ReceiveBlocks   the pool's own leading hits are skipped; a block
                                               is allocated (one reference) for each hash after
                                               them, up to half the free blocks
    finish_receive(t, n)                       the first n blocks, written by the runner, become
                                               findable by their hashes; every block is freed
                                               (the written ones stay cached-free, the rest go
                                               back uncached)
    close(t)                                   abandoned: every block goes back uncached

Sending (the prefill side, or a session's old replica)::

    begin_send(t, hashes, peer) → SendBlocks   one more reference on each block holding the
                                               leading hashes found here, so nothing reuses them
                                               while the runner reads them
    close(t)                                   after the op ran (or failed): the references go

An incoming transfer still open after ``expire_s`` (30 s) is closed by ``expire`` (each
scheduler step): a caller that gave up without a word cannot hold blocks for ever.

Invariants: ``held_refs()`` is the number of references the open transfers hold, which the KV
manager's ``check`` counts; a transfer ends in exactly one ``finish_receive`` or ``close``,
after which it holds nothing; a block is made findable only under the hash it was received for.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvserve.contract.block_ops import ReceiveBlocks, SendBlocks
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.hashing import BlockHash


class PeerTransfers:
    def __init__(self, pool: BlockPool, clock: Callable[[], float] = time.monotonic,
                 expire_s: float = 30.0) -> None:
        self.pool = pool
        self.clock = clock
        self.expire_s = expire_s  # an incoming transfer nobody finished by then is closed
        self._opened: dict[str, float] = {}
        self._open: dict[str, list[tuple[int, BlockHash]]] = {}
        self._peer: dict[str, str] = {}  # incoming transfers: the channel their frames come by

    def begin_receive(self, transfer: str, hashes: list[BlockHash], peer: str) -> ReceiveBlocks | None:
        """Blocks for the hashes after this pool's own leading hits; None if none are wanted."""
        if transfer in self._open:
            raise ValueError(f"transfer {transfer!r} is already open")
        start = 0
        while start < len(hashes) and self.pool.lookup(hashes[start]) is not None:
            start += 1
        want = hashes[start:start + self.pool.num_free // 2]
        if not want:
            return None
        blocks = self.pool.allocate(len(want))
        self._open[transfer] = list(zip(blocks, want, strict=True))
        self._peer[transfer] = peer
        self._opened[transfer] = self.clock()
        return self.receive_op(transfer)

    def receive_op(self, transfer: str) -> ReceiveBlocks | None:
        """The receive of an open incoming transfer (None: it was closed)."""
        held = self._open.get(transfer)
        if held is None or transfer not in self._peer:
            return None
        return ReceiveBlocks([b for b, _ in held], self._peer[transfer], [h for _, h in held])

    def finish_receive(self, transfer: str, written: int) -> int:
        """Make the first ``written`` blocks findable and free them all; returns how many became
        findable (a hash another block gained meanwhile keeps that block)."""
        held = self._open.pop(transfer, [])
        self._peer.pop(transfer, None)
        self._opened.pop(transfer, None)
        cached = 0
        for block, block_hash in held[:written]:
            if self.pool.lookup(block_hash) is None:
                self.pool.cache(block, block_hash)
                cached += 1
        self.pool.free([b for b, _ in reversed(held)])
        return cached

    def begin_send(self, transfer: str, hashes: list[BlockHash], peer: str) -> SendBlocks | None:
        """A send of the blocks holding the leading ``hashes`` found here; None if the first is
        not here."""
        if transfer in self._open:
            raise ValueError(f"transfer {transfer!r} is already open")
        held: list[tuple[int, BlockHash]] = []
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            held.append((block, h))
        if not held:
            return None
        self.pool.touch([b for b, _ in held])
        self._open[transfer] = held
        return SendBlocks([b for b, _ in held], peer, [h for _, h in held])

    def expire(self) -> int:
        """Close incoming transfers open longer than ``expire_s`` (their sender or caller gave up
        without saying so); returns how many."""
        deadline = self.clock() - self.expire_s
        stale = [t for t, at in self._opened.items() if at < deadline]
        for t in stale:
            self.close(t)
        return len(stale)

    def close(self, transfer: str) -> None:
        self._opened.pop(transfer, None)
        self._peer.pop(transfer, None)
        held = self._open.pop(transfer, [])
        self.pool.free([b for b, _ in reversed(held)])

    def held_refs(self) -> int:
        return sum(len(h) for h in self._open.values())
