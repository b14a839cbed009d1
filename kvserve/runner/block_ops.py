"""Run a step's block operations, in order, before its forward: copies in the pool, saves to the
KV tiers (``kvserve.kv.tiers``), and loads from them, handed to the :class:`TierLoader` (they run
beside the forward and are reported when done). What the tiers did is added to ``result``.

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
    RunnerOutput,
    SaveBlock,
)
from kvserve.contract.block_ops import NoTierConfigured
from kvserve.kv.block_io import export_block
from kvserve.kv.storage import KVStorage
from kvserve.kv.tiers.stack import TierStack
from kvserve.runner.tier_loader import TierLoader


def run_block_ops(storage: KVStorage, tiers: TierStack | None, ops: Sequence[BlockOp], result: RunnerOutput,
                  loader: TierLoader | None = None) -> None:
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
        else:
            storage.run_block_ops([op])  # send / receive: refused by the storage until a peer exists
