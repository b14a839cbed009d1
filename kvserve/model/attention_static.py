"""Decode attention over fixed-shape inputs: what a CUDA graph can capture.

A captured graph replays the same kernels on the same buffers, so every shape and every address
is fixed at capture and nothing may depend on a host value: no Python list of lengths, no
``.item()``. This backend attends ``S`` single-query sequences (one decode each) whose block
tables are padded to ``NB`` blocks; the lengths live on the device (``seq_lens``), and the mask of
the keys each row sees is computed there too. The padded rows of a batch bucket repeat a real row
(``src``), so they write that row's K/V, bit for bit, into that row's slot: no scratch slot, and a
replay writes exactly what the eager step would.

Cost against the eager path (:mod:`kvserve.model.attention`): each row gathers all ``NB`` blocks
(the bucket rounds up to a power of two) rather than its own; on a GPU that is memory traffic the
graph's saved launches pay for at decode sizes.

Invariants: ``tables [S, NB]``, ``seq_lens [S]``, ``src [S]`` on the model's device; every row's
``seq_lens`` is at least 1 and at most ``NB * block_size``; ``src[i] == i`` for a real row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kv.layer_kv import LayerKV, as_layer_kv
from kvserve.model.attention import AttentionMetadata


@dataclass(frozen=True)
class StaticDecodePlan:
    """One step's device-side decode inputs, shared by every layer (built inside the graph)."""

    tables: torch.Tensor   # [S, NB] int64 block ids (0 past a row's own blocks: masked)
    src: torch.Tensor      # [S] int64: the row whose new K/V each row writes
    valid: torch.Tensor    # [S, NB * block_size] bool: the keys each row's query sees


def static_plan(tables: torch.Tensor, seq_lens: torch.Tensor, src: torch.Tensor, block_size: int,
                window: int | None) -> StaticDecodePlan:
    """The plan from the step's buffers: row ``i``'s query (position ``seq_lens[i] - 1``) sees the
    keys before ``seq_lens[i]`` and, with a window, only the last ``window`` of them."""
    pos = torch.arange(tables.shape[1] * block_size, device=tables.device)[None, :]
    valid = pos < seq_lens[:, None]
    if window is not None:
        valid &= pos >= (seq_lens - window)[:, None]
    return StaticDecodePlan(tables, src, valid)


VARIANTS = ("sdpa", "matmul")


class StaticDecodeBackend:
    """The attention backend of captured decode steps (``meta.plan`` is a :class:`StaticDecodePlan`).

    ``variant``: ``sdpa`` (torch's ``scaled_dot_product_attention`` with the mask) or ``matmul``
    (scores by a batched GEMM, an fp32 softmax, a second GEMM: the GEMMs spread one decode's keys
    over the GPU where a fused kernel that tiles queries gives one query row one block of threads).
    """

    name = "static_decode"

    def __init__(self, variant: str = "sdpa") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"static decode attention must be one of {', '.join(VARIANTS)}, got {variant!r}")
        self.variant = variant

    def plan(self, meta: AttentionMetadata, kv_shape: tuple[int, ...], device: torch.device) -> StaticDecodePlan:
        raise TypeError("the static decode plan is built from the graph's buffers (static_plan)")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKV | torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q ``[S, H, D]``, k/v ``[S, KVH, D]`` -> ``[S, H, D]``: writes the rows' K/V at
        ``meta.slot_mapping``, then each row attends over its valid keys."""
        p: StaticDecodePlan = meta.plan
        cache = as_layer_kv(kv_cache)
        cache.write(k[p.src], v[p.src], meta.slot_mapping)
        s, heads, d = q.shape
        kvh = cache.shape[3]
        kv = cache.gather_blocks(p.tables).view(2, s, -1, kvh, d)       # [2, S, L, KVH, D] (a copy)
        kv.masked_fill_(~p.valid[None, :, :, None, None], 0)             # unwritten slots may hold NaN
        kv = kv.transpose(2, 3).to(q.dtype)                              # [2, S, KVH, L, D]
        qg = q.view(s, kvh, heads // kvh, d)                             # the g heads of a KV head as rows
        mask = p.valid[:, None, None, :]                                 # [S, 1, 1, L]
        if self.variant == "sdpa":
            o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=mask, scale=scale)
        else:
            scores = torch.matmul(qg, kv[0].transpose(-1, -2)).float().mul_(scale)   # [S, KVH, g, L]
            probs = scores.masked_fill_(~mask, float("-inf")).softmax(-1).to(q.dtype)
            o = torch.matmul(probs, kv[1])
        return o.reshape(s, heads, d)
