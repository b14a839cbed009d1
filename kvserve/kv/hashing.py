"""Chained block hashes for prefix caching, starting from a root key that names the model.

A full block's identity is ``H(parent_hash, token ids of the block)``, and the first block's
parent is the request's *root*::

    engine root  = H("kvserve-kv-v1", model identity, KV codec, block size)      (root_key)
    request root = H(engine root, per-request codec override, cache salt)          (request_root)
    block i      = H(block i-1 | request root, token ids of block i)

Equal hashes therefore mean equal whole prefixes, computed by the same weights into the same
layout: a block saved by one engine can never be loaded by an engine with another model, codec
or block size, and one tenant (salt) never hits another's blocks. The request root is built here
only. Stable across processes and restarts (hashlib, not ``hash()``), so hashes can name blocks
in tiers and across replicas.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from pathlib import Path

BlockHash = bytes
_FORMAT = b"kvserve-kv-v1"


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(4, "little"))  # length-prefixed: no two part lists collide
        h.update(part)
    return h.digest()


def model_identity(model_dir: str | Path) -> str:
    """Hex digest of a checkpoint's ``config.json`` bytes and its weight files' names, sizes and
    three 64 KiB samples of each (start, middle, end): cheap (no full read), and two checkpoints of
    one architecture with different weights differ (random-weight test models do)."""
    root = Path(model_dir)
    config = (root / "config.json").read_bytes() if (root / "config.json").exists() else b""
    parts = [config]
    for p in sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file()):
        size = p.stat().st_size
        parts.append(json.dumps([p.name, size]).encode())
        with open(p, "rb") as f:
            for offset in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                f.seek(offset)
                parts.append(f.read(_SAMPLE))
    return _digest(*parts).hex()


_SAMPLE = 64 * 1024


def root_key(model_id: str, kv_codec: str, block_size: int) -> BlockHash:
    """The engine's root: what every block of this engine's pool shares."""
    return _digest(_FORMAT, model_id.encode(), kv_codec.encode(), str(block_size).encode())


def request_root(engine_root: BlockHash, kv_codec: str | None = None, cache_salt: str | None = None) -> BlockHash:
    """A request's root: the engine root, unless the request overrides the codec or has a salt.
    ``cache_salt=""`` is a salt (distinct from no salt)."""
    if kv_codec is None and cache_salt is None:
        return engine_root
    return _digest(engine_root, b"codec" if kv_codec is not None else b"", (kv_codec or "").encode(),
                   b"salt" if cache_salt is not None else b"", (cache_salt or "").encode())


def hash_block(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    """Hash of one full block, chained to its parent block's hash (the request root for the first)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_full_blocks(token_ids: list[int], block_size: int, root: BlockHash,
                     start: list[BlockHash] | None = None) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` under ``root``, extending the known ``start``."""
    hashes = list(start or [])
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else root
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes
