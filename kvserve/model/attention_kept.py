"""Attention over the keys a sequence still keeps: sinks, a window, dropped blocks, scores.

The plain path of :mod:`kvserve.model.attention` reads one contiguous run of positions
(``first .. seq_len - 1``). A sequence under an eviction policy reads less: the blocks its table
still holds (a ``None`` entry was dropped), and, with ``sinks``, its first tokens as well as its
window. This module gathers exactly those keys, masks them token-exactly by their *original*
positions (keys keep the rotation they were written with; no re-rotation), and, when a policy
asks, reports how much attention each block received (``block_scores``)::

    keys gathered   | sink blocks | ...dropped... | blocks from the window's first one to seq_len |
    kpos            original position of every gathered key
    mask[q, k]      kpos <= qpos  and  (kpos > qpos - window  or  kpos < sinks)

Scores: ``softmax(q k^T * scale)`` of the chunk's last ``m`` queries, summed over query heads and
those queries, then over each block's keys: one float per logical block (dropped blocks 0).
Computed only for sequences that ask (``score_queries > 0``); the others never pay for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kv.layer_kv import LayerKV


@dataclass(frozen=True)
class KeptKeys:
    """What one sequence reads: ``blocks`` (logical indices, ascending) and the rule."""

    blocks: list[int]
    first: int          # the first window position any query of the chunk reads
    sinks: int
    window: int | None


def kept_keys(seq_len: int, q_len: int, block_size: int, window: int | None, sinks: int,
              dropped: frozenset[int]) -> KeptKeys:
    """The logical blocks a chunk of ``q_len`` queries ending at ``seq_len`` reads."""
    first = 0 if window is None else max(0, seq_len - q_len - window + 1)
    n = -(-seq_len // block_size)
    wanted = set(range(first // block_size, n))
    if sinks and first:
        wanted |= set(range(min(n, -(-sinks // block_size))))
    return KeptKeys(sorted(wanted - dropped), first, sinks, window)


def needs_kept_path(seq_len: int, q_len: int, block_size: int, window: int | None, sinks: int,
                    dropped: frozenset[int], scores: int) -> bool:
    """False when the plain contiguous path computes the same thing (the common case). Sinks
    matter as soon as the window hides any key from the chunk's last query (``seq_len > window``):
    the hidden keys start at 0, a sink."""
    if scores or (sinks and window is not None and seq_len > window):
        return True
    if not dropped:
        return False
    first = 0 if window is None else max(0, seq_len - q_len - window + 1)
    return max(dropped) >= first // block_size


def attend_kept(q: torch.Tensor, cache: LayerKV, table: torch.Tensor, seq_len: int, keys: KeptKeys,
                scale: float, score_queries: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One sequence: q ``[q_len, H, D]`` at positions ``seq_len - q_len .. seq_len - 1`` ->
    (``[q_len, H, D]``, per-logical-block attention of the last ``score_queries`` queries
    ``[ceil(seq_len / bs)]`` float32, or None)."""
    bs = cache.shape[2]
    q_len, heads, d = q.shape
    idx = torch.tensor(keys.blocks, dtype=torch.long)
    kv = cache.gather_blocks(table.index_select(0, idx.to(table.device)))    # [2, m, bs, KVH, D]
    kpos = (idx[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)       # [m * bs]
    keep = (kpos < seq_len) & ((kpos >= keys.first) | (kpos < keys.sinks))
    kv = kv.reshape(2, -1, *kv.shape[3:])[:, keep.to(kv.device)]             # [2, L, KVH, D]
    kpos = kpos[keep].to(q.device)
    qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    mask = kpos[None, :] <= qpos
    if keys.window is not None:
        mask &= (kpos[None, :] > qpos - keys.window) | (kpos[None, :] < keys.sinks)  # [q_len, L]
    kvh = kv.shape[2]
    g = heads // kvh
    k = kv[0].transpose(0, 1).to(q.dtype)                                    # [KVH, L, D]
    v = kv[1].transpose(0, 1).to(q.dtype)
    qg = q.view(q_len, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * q_len, d)
    m = mask.repeat(g, 1) if g > 1 else mask                                 # rows (group, query)
    out = F.scaled_dot_product_attention(qg[None], k[None].contiguous(), v[None].contiguous(),
                                         attn_mask=m, scale=scale)[0]
    out = out.view(kvh, g, q_len, d).permute(2, 0, 1, 3).reshape(q_len, heads, d)
    if not score_queries:
        return out, None
    last = min(score_queries, q_len)
    qs = qg.view(kvh, g, q_len, d)[:, :, q_len - last:].float()              # [KVH, g, last, D]
    logits = torch.einsum("hgqd,hld->hgql", qs, k.float()) * scale
    logits = logits.masked_fill(~mask[q_len - last:][None, None], float("-inf"))
    mass = logits.softmax(-1).sum(dim=(0, 1, 2))                             # [L]
    per_block = torch.zeros(-(-seq_len // bs), dtype=torch.float32, device=q.device)
    per_block.index_add_(0, torch.div(kpos, bs, rounding_mode="floor"), mass)
    return out, per_block
