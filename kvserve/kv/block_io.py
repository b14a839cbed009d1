"""Export a pool block as a self-describing :class:`~kvserve.contract.block_ops.BlockPayload`, and
import one into a block: the byte-level half of ``SaveBlock`` / ``LoadBlock`` (the tiers issue adds
where the bytes go). Round trip invariant: after ``import_block(s, export_block(s, a), b)`` block
``b`` reads exactly what block ``a`` read (full-precision shadow rows aside: a restored block reads
its codec data, which every written token of a sealed block has).
"""

from __future__ import annotations

import torch

from kvserve.contract.block_ops import BlockNotSealed, BlockPayload
from kvserve.kv.storage import KVStorage


def export_block(s: KVStorage, block_id: int) -> BlockPayload:
    shadow = s.window.get(block_id)
    if shadow is not None and shadow.tail and s.fill[block_id] < s.block_size:
        raise BlockNotSealed(f"block {block_id} holds an unfinished int4 key group ({s.fill[block_id]} of "
                             f"{s.block_size} tokens); save it once full or sealed")
    k = [s.k_regions[layer][block_id].contiguous().numpy().tobytes() for layer in range(s.num_layers)]
    v = [s.v_regions[layer][block_id].contiguous().numpy().tobytes() for layer in range(s.num_layers)]
    return BlockPayload(s.codecs.name_of(s.block_pair[block_id]), s.block_size, s.kv_heads, s.head_dim, s.fill[block_id], k, v)


def import_block(s: KVStorage, payload: BlockPayload, block_id: int) -> None:
    """Write ``payload`` into ``block_id`` (which must be free of other holders: the caller owns it)."""
    layout = (payload.block_size, payload.kv_heads, payload.head_dim, len(payload.k))
    if layout != (s.block_size, s.kv_heads, s.head_dim, s.num_layers):
        raise ValueError(f"block payload layout {layout} (block size, KV heads, head dim, layers) does not "
                         f"match this pool's {(s.block_size, s.kv_heads, s.head_dim, s.num_layers)}")
    pid = s.pair_for(payload.codec)
    sizes = [(s.k_regions[layer].shape[1], s.v_regions[layer].shape[1]) for layer in range(s.num_layers)]
    if [(len(k), len(v)) for k, v in zip(payload.k, payload.v)] != sizes:
        raise ValueError(f"block payload regions are not this pool's (K, V) bytes per layer {sizes}")
    for layer in range(s.num_layers):
        s.k_regions[layer][block_id] = torch.frombuffer(bytearray(payload.k[layer]), dtype=torch.uint8)
        s.v_regions[layer][block_id] = torch.frombuffer(bytearray(payload.v[layer]), dtype=torch.uint8)
    s.restart_block(block_id, pid)
    s.fill[block_id] = payload.num_tokens
    s.pairs_used.add(pid)
