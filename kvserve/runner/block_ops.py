"""Run a step's block operations, in order, before its forward: copies in the pool, saves to the
KV tiers (``kvserve.kv.tiers``), and loads from them, handed to the :class:`TierLoader` (they run
beside the forward and are reported when done). What the tiers did is added to ``result``.
Sends and receives go through the runner's :class:`~kvserve.runner.peers.PeerHub`: a send
writes each block as a verified object (the tiers' format), a receive writes the leading blocks
whose objects pass their checks (root key, hash, checksum) and reports how many in
``result.received``; the blocks after the first bad or missing one are left unwritten.

A save of a block that cannot be made self-describing yet (a partial int4 block) is skipped: the
block is simply not in the tier, and a later lookup recomputes it. A load that finds nothing
valid leaves the block unwritten and reports ``tier=None``; the scheduler then frees that block
and recomputes from it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.contract import (
    BlockNotSealed,
    BlockOp,
    CopyBlock,
    LoadBlock,
    ReceiveBlocks,
    RunnerOutput,
    SaveBlock,
    SendBlocks,
)
from kvserve.contract.block_ops import NoTierConfigured
from kvserve.kv.block_io import export_block, import_block
from kvserve.kv.storage import KVStorage
from kvserve.kv.tiers import object_format
from kvserve.kv.tiers.stack import TierStack
from kvserve.runner.peers import PeerAddress, PeerError, PeerHub
from kvserve.runner.tier_loader import TierLoader


def run_block_ops(storage: KVStorage, tiers: TierStack | None, ops: Sequence[BlockOp], result: RunnerOutput,
                  loader: TierLoader | None = None, peers: PeerHub | None = None, root: bytes = b"") -> None:
    for op in ops:
        if isinstance(op, CopyBlock):
            storage.run_block_ops([op])
        elif isinstance(op, (SaveBlock, LoadBlock)) and not tiers:
            raise NoTierConfigured(f"{type(op).__name__} needs a KV tier, and none is configured")
        elif isinstance(op, SaveBlock):
            assert tiers is not None
            try:
                payload = export_block(storage, op.block_id)
            except BlockNotSealed:
                continue
            result.tier_events += tiers.save(op.key, op.parent, payload)
        elif isinstance(op, LoadBlock):
            assert loader is not None, "a runner with tiers has a loader"
            loader.submit(op)
        elif isinstance(op, (SendBlocks, ReceiveBlocks)) and peers is None:
            storage.run_block_ops([op])  # refused: this runner has no peer channel
        elif isinstance(op, SendBlocks):
            assert peers is not None
            send_blocks(storage, peers, op, root)
        elif isinstance(op, ReceiveBlocks):
            assert peers is not None
            result.received[op.peer] = receive_blocks(storage, peers, op, root)
        else:
            storage.run_block_ops([op])


def send_blocks(storage: KVStorage, peers: PeerHub, op: SendBlocks, root: bytes) -> None:
    """Encode ``op``'s blocks (each chained to the one before) and hand them to the channel.
    Raises :class:`PeerError` when the channel cannot deliver them."""
    frames: list[bytes] = []
    parent = b""
    for block_id, key in zip(op.block_ids, op.keys, strict=True):
        try:
            payload = export_block(storage, block_id)
        except BlockNotSealed:
            break  # a prefix only: the receiver takes the blocks before this one
        frames.append(object_format.encode(payload, root=root, block_hash=key, parent=parent))
        parent = key
    peers.send(op.peer, frames)


def receive_blocks(storage: KVStorage, peers: PeerHub, op: ReceiveBlocks, root: bytes) -> int:
    """Write the leading frames of ``op``'s transfer that pass their checks; returns how many."""
    frames = peers.take(PeerAddress.parse(op.peer).transfer) or []
    n = 0
    for block_id, key, frame in zip(op.block_ids, op.keys, frames):
        try:
            _, payload = object_format.decode(frame, root=root, block_hash=key)
            import_block(storage, payload, block_id)
        except ValueError:  # CorruptBlock, or a layout this pool does not have
            break
        n += 1
    return n


__all__ = ["PeerError", "receive_blocks", "run_block_ops", "send_blocks"]
