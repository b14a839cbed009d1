"""Block operations: the only way KV moves between blocks, tiers and processes.

A step's :class:`~kvserve.contract.records.SchedulerOutput` lists them; the storage runs them, in
order, *before* the forward, so the forward already sees copied or loaded blocks::

    CopyBlock(src, dst)            pool → pool        copy-on-write of a shared block (works today)
    SaveBlock(block_id, key)       pool → a tier      the block's self-describing bytes under ``key``
    LoadBlock(key, block_id)       a tier → pool      restores a saved block into ``block_id``
    SendBlocks(block_ids, peer)    pool → a peer      another engine (prefill/decode split, a session move)
    ReceiveBlocks(block_ids, peer) a peer → pool

A send or receive names each block's hash (``keys``): a block travels as the same verified object
a tier holds (:mod:`kvserve.kv.tiers.object_format`), so the receiver checks root key, hash and
checksum before writing it. ``peer`` names a channel and a transfer (:mod:`kvserve.runner.peers`):
``tcp://host:port/<transfer>`` (direct, sender to receiver) or ``ray:<transfer>`` (the frames are
handed back to the caller, who moves them through Ray's object store).

``key`` is a block's chained prefix hash, which starts from the root key naming the model, the KV
codec and the block size (:mod:`kvserve.kv.hashing`), so a block saved by one engine can never be
loaded by an engine with another model or layout. Until a tier or a peer is configured, the
storage refuses the last four with :class:`NoTierConfigured`.
"""

from __future__ import annotations

import msgspec


class CopyBlock(msgspec.Struct, frozen=True, tag="copy"):
    src: int
    dst: int


class SaveBlock(msgspec.Struct, frozen=True, tag="save"):
    block_id: int
    key: bytes
    parent: bytes = b""  # the previous block's hash (the request root for a first block)


class LoadBlock(msgspec.Struct, frozen=True, tag="load"):
    key: bytes
    block_id: int
    tier: str = ""  # where the scheduler's index last saw it (a hint: the runner reads the fastest valid copy)


class SendBlocks(msgspec.Struct, frozen=True, tag="send"):
    block_ids: list[int]
    peer: str
    keys: list[bytes] = msgspec.field(default_factory=list)  # each block's hash, in order


class ReceiveBlocks(msgspec.Struct, frozen=True, tag="receive"):
    block_ids: list[int]
    peer: str
    keys: list[bytes] = msgspec.field(default_factory=list)  # the hash each block must carry


BlockOp = CopyBlock | SaveBlock | LoadBlock | SendBlocks | ReceiveBlocks


class NoTierConfigured(RuntimeError):
    """A save/load/send/receive operation reached a storage with no tier or peer to serve it."""


class BlockPayload(msgspec.Struct, frozen=True):
    """A block made self-describing, what ``SaveBlock`` writes and ``LoadBlock`` reads: its codec
    (canonical name), the layout it was written in, how many tokens it holds, and each layer's K
    and V region bytes exactly as the pool holds them (codec fields, or raw float rows).

    A block is restorable from this alone into any pool of the same layout whose codec pairs
    include ``codec``. A partial int4 block whose key group is not yet encoded (its keys live in
    the full-precision window) is refused by the exporter (:class:`BlockNotSealed`)."""

    codec: str
    block_size: int
    kv_heads: int
    head_dim: int
    num_tokens: int
    k: list[bytes]
    v: list[bytes]

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.k)) + sum(map(len, self.v))


class BlockNotSealed(RuntimeError):
    """The block's int4 keys are not encoded yet (an unfinished group): it cannot be saved as it is."""
