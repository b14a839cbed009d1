"""One object per block: header + payload + checksum, written and read whole.

::

    | "KVSB" | version u16 | header length u32 | header (msgpack) | payload (msgpack BlockPayload) | blake2b-16 |
      header = {root, hash, parent, codec, num_tokens, payload_len}

The checksum covers every byte before it, so a torn, truncated or flipped object never decodes:
:func:`decode` raises :class:`CorruptBlock`, and the caller deletes it and recomputes. A valid
object whose ``root`` differs from the reader's (another model, codec or block size) or whose
``hash`` is not the one asked for is refused the same way. Plain Python, no torch.
"""

from __future__ import annotations

import hashlib
import struct

import msgspec

from kvserve.contract.block_ops import BlockPayload

MAGIC = b"KVSB"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")
_SUM = 16


class CorruptBlock(ValueError):
    """A block object failed its checks (checksum, framing, root key or hash)."""


class BlockHeader(msgspec.Struct, frozen=True):
    root: bytes
    hash: bytes
    parent: bytes
    codec: str
    num_tokens: int
    payload_len: int


def encode(payload: BlockPayload, *, root: bytes, block_hash: bytes, parent: bytes) -> bytes:
    body = msgspec.msgpack.encode(payload)
    header = msgspec.msgpack.encode(BlockHeader(root, block_hash, parent, payload.codec, payload.num_tokens,
                                                len(body)))
    data = _PREFIX.pack(MAGIC, VERSION, len(header)) + header + body
    return data + hashlib.blake2b(data, digest_size=_SUM).digest()


def decode(data: bytes, *, root: bytes, block_hash: bytes) -> tuple[BlockHeader, BlockPayload]:
    """The header and payload of a verified object. Raises :class:`CorruptBlock`."""
    if len(data) < _PREFIX.size + _SUM:
        raise CorruptBlock(f"block object too short ({len(data)} bytes)")
    body, checksum = data[:-_SUM], data[-_SUM:]
    if hashlib.blake2b(body, digest_size=_SUM).digest() != checksum:
        raise CorruptBlock("block object checksum mismatch")
    magic, version, header_len = _PREFIX.unpack_from(body)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock(f"not a kvserve block object (magic {magic!r}, version {version})")
    start = _PREFIX.size
    try:
        header = msgspec.msgpack.decode(body[start:start + header_len], type=BlockHeader)
        payload_bytes = body[start + header_len:]
        if len(payload_bytes) != header.payload_len:
            raise CorruptBlock("block object payload length mismatch")
        payload = msgspec.msgpack.decode(payload_bytes, type=BlockPayload)
    except msgspec.DecodeError as exc:
        raise CorruptBlock(f"block object does not decode: {exc}") from None
    if header.root != root:
        raise CorruptBlock("block object belongs to another model, codec or block size (root key differs)")
    if header.hash != block_hash:
        raise CorruptBlock("block object holds another block (hash differs)")
    return header, payload
