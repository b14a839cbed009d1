"""The plain-data contract between the scheduler, the runner and the KV storage.

Everything here is data: ``msgspec.Struct`` records with no behaviour beyond derived properties,
no tensors and no references to live objects, so a step can be pickled, sent to another process
(:mod:`kvserve.runner.process_runner`), logged and replayed. Neither side imports the other:
the scheduler builds :class:`SchedulerOutput` and reads :class:`RunnerOutput`; the runner does
the opposite.
"""

from kvserve.contract.block_ops import (
    BlockNotSealed,
    BlockOp,
    BlockPayload,
    CopyBlock,
    LoadBlock,
    NoTierConfigured,
    ReceiveBlocks,
    SaveBlock,
    SendBlocks,
)
from kvserve.contract.records import (
    LoadResult,
    NewRequest,
    RunnerOutput,
    SampledTokens,
    ScheduledChunk,
    SchedulerOutput,
    TierEvent,
    TokenLogprobs,
)

__all__ = [
    "BlockNotSealed",
    "BlockOp",
    "BlockPayload",
    "CopyBlock",
    "LoadBlock",
    "LoadResult",
    "NewRequest",
    "NoTierConfigured",
    "ReceiveBlocks",
    "RunnerOutput",
    "SampledTokens",
    "SaveBlock",
    "ScheduledChunk",
    "SchedulerOutput",
    "SendBlocks",
    "TierEvent",
    "TokenLogprobs",
]
