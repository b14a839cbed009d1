"""Chained block hashes for prefix caching.

A full block's identity is ``H(parent_hash, token ids of the block, extra keys)``: equal hashes
mean equal whole prefixes, not just equal blocks. ``extra`` carries what else makes KV differ
(a tenant's ``cache_salt``, the KV codec), so one tenant can never hit another tenant's blocks.
Stable across processes (hashlib, not ``hash()``), so hashes can name blocks on disk later.
"""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: list[int], extra: tuple[str, ...] = ()) -> BlockHash:
    """Hash of one full block, chained to its parent block's hash (None for the first block)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\x00" * 16)
    h.update(array("q", token_ids).tobytes())
    for key in extra:
        h.update(b"\x1f")
        h.update(key.encode())
    return h.digest()


def hash_full_blocks(token_ids: list[int], block_size: int, extra: tuple[str, ...] = (),
                     start: list[BlockHash] | None = None) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, extending the already-known ``start`` list."""
    hashes = list(start or [])
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
    return hashes
