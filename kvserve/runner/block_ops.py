"""Run a step's block operations, in order, before its forward: copies in the pool, saves to and
loads from the KV tiers (``kvserve.kv.tiers``). What the tiers did is added to ``result``.

A save of a block that cannot be made self-describing yet (a partial int4 block) is skipped: the
block is simply not in the tier, and a later lookup recomputes it. A load that finds nothing
valid leaves the block unwritten and reports ``tier=None``; the scheduler then frees that block
and recomputes from it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvserve.contract import (
    BlockNotSealed,
    BlockOp,
    CopyBlock,
    LoadBlock,
    LoadResult,
    RunnerOutput,
    SaveBlock,
)
from kvserve.contract.block_ops import NoTierConfigured
from kvserve.kv.block_io import export_block, import_block
from kvserve.kv.storage import KVStorage
from kvserve.kv.tiers.stack import TierStack


def run_block_ops(storage: KVStorage, tiers: TierStack | None, ops: Sequence[BlockOp], result: RunnerOutput) -> None:
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
            assert tiers is not None
            t0 = time.perf_counter()
            payload, tier, events = tiers.load(op.key)
            result.tier_events += events
            if payload is not None:
                try:
                    import_block(storage, payload, op.block_id)
                except ValueError:
                    tier = None
            result.loaded.append(LoadResult(op.key, op.block_id, tier, time.perf_counter() - t0))
        else:
            storage.run_block_ops([op])  # send / receive: refused by the storage until a peer exists
