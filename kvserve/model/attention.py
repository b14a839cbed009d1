"""Paged attention: write new K/V by slot, read the context through block tables.

KV storage for one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = K, 1 = V). A token's *slot* is ``block_id * block_size + offset``; the runner hands
the model one slot per scheduled token (``slot_mapping``) and one block table per sequence.

A step packs every scheduled sequence's new tokens into one flat batch (no padding)::

    tokens:  | seq0 new tokens | seq1 new tokens | ... |
    query_start_loc = [0, q0, q0+q1, ...]            (B + 1 python ints)
    seq_lens        = [ctx0, ctx1, ...]              context length *after* this step
    seq i's queries are positions  ctx_i - q_i … ctx_i - 1  of its sequence

Metadata is passed explicitly (no module-level globals), built by ``kvserve.runner.inputs``.

A layer's cache is any :class:`kvserve.kv.layer_kv.LayerKV` (the float pool's tensor, or a
codec-aware view for fp8/int8/int4 that decodes only the blocks asked for): attention calls its
``write`` and ``gather_blocks`` and never asks which kind it has. This module is the ``torch_sdpa``
backend of :mod:`kvserve.model.attention_backends`; its step plan (which decodes are batched) is
built once per step by the runner (:func:`plan_step`), not by the first layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.kv.layer_kv import LayerKV, as_layer_kv
from kvserve.model.attention_kept import attend_kept, kept_keys, needs_kept_path


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by all layers.

    Invariants: ``len(query_start_loc) == len(seq_lens) + 1 == len(block_tables) + 1``;
    ``query_start_loc[-1] == slot_mapping.numel()``; every query length ``q_i <= seq_lens[i]``;
    ``block_tables[i]`` holds at least ``ceil(seq_lens[i] / block_size)`` block ids.
    """

    slot_mapping: torch.Tensor          # [T] int64, flat slot per new token
    query_start_loc: list[int]          # [B + 1]
    seq_lens: list[int]                 # [B]
    block_tables: list[torch.Tensor]    # B tensors of int64 block ids
    block_size: int
    sliding_window: int | None = None
    # The backend's per-step plan, built once by the runner (the backend's ``plan``); None lets
    # a direct caller (tests) have it built per call.
    plan: Any = None
    backend: Any = None  # an AttentionBackend (kvserve.model.attention_backends); None = torch_sdpa
    # Eviction (kvserve.kv.press; None: nothing for any sequence): a sequence's own window and
    # sinks (narrowing ``sliding_window``), its dropped logical blocks, how many of its last
    # queries score blocks; ``block_scores`` collects those scores, summed over layers.
    seq_windows: list[int | None] | None = None
    seq_sinks: list[int] | None = None
    dropped: list[frozenset[int]] | None = None
    score_queries: list[int] | None = None
    block_scores: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def window_of(self, i: int) -> int | None:
        own = self.seq_windows[i] if self.seq_windows is not None else None
        ws = [w for w in (self.sliding_window, own) if w is not None]
        return min(ws) if ws else None

    def sinks_of(self, i: int) -> int:
        return self.seq_sinks[i] if self.seq_sinks is not None else 0

    def dropped_of(self, i: int) -> frozenset[int]:
        return self.dropped[i] if self.dropped is not None else frozenset()

    def scores_of(self, i: int) -> int:
        return self.score_queries[i] if self.score_queries is not None else 0

    def kept_path(self, i: int) -> bool:
        """Sequence ``i`` reads sinks, skips dropped blocks in its range, or scores blocks."""
        q_len = self.query_start_loc[i + 1] - self.query_start_loc[i]
        return needs_kept_path(self.seq_lens[i], q_len, self.block_size, self.window_of(i), self.sinks_of(i),
                               self.dropped_of(i), self.scores_of(i))

    @property
    def all_decode(self) -> bool:
        """True when every sequence contributes exactly one query token."""
        return self.query_start_loc[-1] == len(self.seq_lens)


# Largest padded K+V gather (elements) the batched single-query path may make per layer; beyond
# it those sequences take the per-sequence loop (whose cost is then dominated by real work).
MAX_BATCHED_DECODE_ELEMENTS = 32 * 2**20


@dataclass(frozen=True)
class DecodeBatch:
    """Sequences with exactly one query token, attended in one batched call.

    ``rows``: their token rows in the flat batch ``[S]``; ``tables``: their block tables padded to
    the longest ``[S, n_blocks]``; ``valid``: which of the first ``context_len`` gathered slots each
    attends ``[S, context_len]`` (``None`` when all do: equal lengths and no window cut).
    """

    rows: torch.Tensor
    tables: torch.Tensor
    valid: torch.Tensor | None
    context_len: int


@dataclass(frozen=True)
class StepPlan:
    """How a step's sequences are attended: ``batch`` (if any) and the rest one by one (``loop``)."""

    batch: DecodeBatch | None
    loop: list[int]


def plan_step(meta: AttentionMetadata, kv_shape: tuple[int, ...], device: torch.device) -> StepPlan:
    """Which single-query sequences are attended in one batched call; ``kv_shape`` is a layer's
    ``(2, num_blocks, block_size, kv_heads, head_dim)``. Each row gathers its blocks from the
    first one its window reads (dropped blocks inside it are masked); sequences with sinks or
    scores take the per-sequence path."""
    single = [i for i in range(meta.num_seqs) if meta.query_start_loc[i + 1] - meta.query_start_loc[i] == 1
              and not (meta.sinks_of(i) or meta.scores_of(i))]
    bs = meta.block_size
    lens = [meta.seq_lens[i] for i in single]
    windows = [meta.window_of(i) for i in single]
    firsts = [0 if w is None else max(0, n - w) for n, w in zip(lens, windows)]
    b0 = [f // bs for f in firsts]
    n_blocks = max((-(-n // bs) - b for n, b in zip(lens, b0)), default=0)
    per_token = kv_shape[3] * kv_shape[4] * 2
    if len(single) < 2 or len(single) * n_blocks * bs * per_token > MAX_BATCHED_DECODE_ELEMENTS:
        return StepPlan(None, list(range(meta.num_seqs)))
    tables = torch.zeros(len(single), n_blocks, dtype=torch.int64)
    holes = False
    for row, i in enumerate(single):
        t = meta.block_tables[i][b0[row]:b0[row] + n_blocks]
        tables[row, : t.numel()] = t
        holes = holes or any(d >= b0[row] for d in meta.dropped_of(i))
    valid = None
    context_len = max(lens)
    if holes or any(b0) or min(lens) != max(lens) or any(f > 0 for f in firsts):
        start = torch.tensor(b0)[:, None] * bs
        pos = start + torch.arange(n_blocks * bs)[None, :]            # [S, L] original positions
        valid = (pos < torch.tensor(lens)[:, None]) & (pos >= torch.tensor(firsts)[:, None])
        for row, i in enumerate(single):
            for d in meta.dropped_of(i):
                if d >= b0[row]:
                    valid[row, (d - b0[row]) * bs:(d - b0[row] + 1) * bs] = False
        context_len = n_blocks * bs
    rows = torch.tensor([meta.query_start_loc[i] for i in single], dtype=torch.int64)
    batch = DecodeBatch(rows.to(device), tables.to(device), None if valid is None else valid.to(device),
                        context_len)
    chosen = set(single)
    return StepPlan(batch, [i for i in range(meta.num_seqs) if i not in chosen])


def gather_context(kv_cache: LayerKV, block_table: torch.Tensor, seq_len: int, first: int = 0) -> torch.Tensor:
    """One sequence's keys and values at positions ``first … seq_len - 1``:
    ``[2, seq_len - first, kv_heads, head_dim]`` (index 0 = K; a view of one gathered copy)."""
    block_size = kv_cache.shape[2]
    b0, n_blocks = first // block_size, -(-seq_len // block_size)
    blocks = kv_cache.gather_blocks(block_table[b0:n_blocks])  # [2, n, block_size, kvh, d]
    off = first - b0 * block_size
    return blocks.view(2, (n_blocks - b0) * block_size, *kv_cache.shape[3:])[:, off:seq_len - b0 * block_size]


def _causal_mask(q_len: int, kv_len: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean mask ``[q_len, kv_len]`` (True = attend) for queries at the last ``q_len`` positions;
    ``None`` when every query sees every key."""
    if q_len == 1 and (window is None or kv_len <= window):
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def heads_major(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[2, *, L, KVH, D]`` (the cache's token-major layout) -> contiguous ``[2, *, KVH, L, D]`` in
    ``dtype``, in one copy.

    torch's CPU flash attention is handed contiguous rows instead of rows ``KVH * D`` apart (a
    transposed view of the token-major layout): measured (bf16, paged_attention alone, A/B in one
    process) 0.86x the time for one decode at 512 context, 0.93x for 16 decodes at 384, equal at
    2K-3.5K context and for prefill chunks.
    """
    return kv.transpose(-3, -2).to(dtype, memory_format=torch.contiguous_format)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            mask: torch.Tensor | None, scale: float, causal: bool = False) -> torch.Tensor:
    """One sequence: q ``[q_len, H, D]``, keys/values head-major ``[KVH, L, D]`` (contiguous, q's
    dtype) -> ``[q_len, H, D]``.

    ``causal`` (a prompt's first chunk: ``q_len == L``, no window cuts it, ``mask`` None): torch's
    own causal flash attention with ``enable_gqa``, which skips the masked half (a 2,048-token
    prompt, 14 heads over 2 KV heads, bf16, one layer, AMX Xeon: 12-15 ms against 50-55 ms through
    the stacked form with a mask below; ``benchmarks/cpu_ops.py``).

    Otherwise the grouped-query form: the ``g = H / KVH`` query heads sharing a KV head are stacked
    as ``g * q_len`` query rows of that KV head (head ``h`` uses KV head ``h // g``, as in
    transformers' ``repeat_kv``), so SDPA runs batched over KV heads without repeating K/V.
    (``enable_gqa=True`` with a mask gives the same result but is far slower on CPU in torch 2.13.)
    """
    q_len, heads, d = q.shape
    kv_heads = keys.shape[0]
    if causal:
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], is_causal=True,
                                           scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    g = heads // kv_heads
    qg = q.view(q_len, kv_heads, g, d).permute(1, 2, 0, 3).reshape(kv_heads, g * q_len, d)
    if mask is not None and g > 1:
        mask = mask.repeat(g, 1)                                   # rows ordered (group, query)
    # 4-D inputs (batch 1): torch's CPU flash kernel only takes 4-D; 3-D falls back to the slow
    # math path (5x slower for bf16 at 2K context).
    o = F.scaled_dot_product_attention(qg[None], keys[None], values[None], attn_mask=mask, scale=scale)
    return o.view(kv_heads, g, q_len, d).permute(2, 0, 1, 3).reshape(q_len, heads, d)


def _attend_split(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: int, scale: float) -> torch.Tensor:
    """A later chunk: q ``[q_len, H, D]``, the ``q_len`` new tokens after ``ctx > 0`` cached ones;
    keys/values head-major ``[KVH, ctx + q_len, D]`` -> ``[q_len, H, D]``. No window cuts it.

    Cascade form (FlashInfer's and vLLM's for a shared prefix): every query sees every cached key,
    so the cached part needs no mask and runs torch's flash kernel on the GQA-stacked queries
    (``g * q_len`` rows per KV head); the chunk attends itself causally; the two partial outputs are
    merged by their log-sum-exps in fp32::

        o = (o_ctx · e^(lse_ctx - m) + o_chunk · e^(lse_chunk - m)) / (e^(lse_ctx - m) + e^(lse_chunk - m))

    which is the softmax over all ``ctx + q_len`` visible keys (each part is rounded to q's dtype
    once before the merge). Against the masked form (``_attend``) it skips the mask's ``q_len x
    (ctx + q_len)`` tensor and the flash kernel's masked tiles.
    """
    q_len, heads, d = q.shape
    kv_heads = keys.shape[0]
    g = heads // kv_heads
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qg = q.view(q_len, kv_heads, g, d).permute(1, 2, 0, 3).reshape(1, kv_heads, g * q_len, d)
    o1, l1 = flash(qg, keys[None, :, :ctx], values[None, :, :ctx], 0.0, False, scale=scale)[:2]
    o1 = o1.view(kv_heads, g, q_len, d).permute(2, 0, 1, 3).reshape(q_len, heads, d).float()
    l1 = l1.view(kv_heads, g, q_len).permute(2, 0, 1).reshape(q_len, heads, 1)
    kc, vc = (t[:, ctx:].repeat_interleave(g, 0)[None] for t in (keys, values))   # [1, H, q_len, D]
    o2, l2 = flash(q.transpose(0, 1)[None], kc, vc, 0.0, True, scale=scale)[:2]
    o2, l2 = o2[0].transpose(0, 1).float(), l2[0].transpose(0, 1)[..., None]
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return ((o1 * w1 + o2 * w2) / (w1 + w2)).to(q.dtype)


def _attend_decode_batch(q: torch.Tensor, kv_cache: LayerKV, plan: DecodeBatch, scale: float) -> torch.Tensor:
    """S single-query sequences at once: q ``[S, H, D]`` -> ``[S, H, D]``.

    Contexts are gathered padded to the longest; padded or out-of-window slots are zeroed (caches
    may be ``torch.empty``, and 0 * NaN would poison the sum) and masked out.
    """
    s, heads, d = q.shape
    kv_heads = kv_cache.shape[3]
    g = heads // kv_heads
    kv = kv_cache.gather_blocks(plan.tables)                       # [2, S, nb, bs, KVH, D] (a copy)
    kv = kv.view(2, s, -1, kv_heads, d)[:, :, : plan.context_len]  # [2, S, L, KVH, D]
    mask = None
    if plan.valid is not None:
        kv.masked_fill_(~plan.valid[None, :, :, None, None], 0)
        mask = plan.valid[:, None, None, :]                        # [S, 1, 1, L]
    kv = heads_major(kv, q.dtype)                                  # [2, S, KVH, L, D]
    qg = q.view(s, kv_heads, g, d)                                 # [S, KVH, g, D]
    o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=mask, scale=scale)
    return o.reshape(s, heads, d)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: LayerKV | torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention over the paged cache.

    q: ``[T, heads, head_dim]``; k, v: ``[T, kv_heads, head_dim]`` (the new tokens, already
    rotated). Writes k/v into ``kv_cache`` first, then each sequence attends over its whole
    context read through its block table. Returns ``[T, heads, head_dim]``.

    Sequences with one query token (decodes) are attended together in one batched call when
    there are several (:class:`DecodePlan`); the others (prefill chunks) one by one. Both paths
    compute the same attention (equal up to float rounding).
    """
    cache = as_layer_kv(kv_cache)
    cache.write(k, v, meta.slot_mapping)
    plan: StepPlan = meta.plan if meta.plan is not None else plan_step(meta, cache.shape, q.device)
    return attend_written(q, cache, meta, plan, scale, torch.empty_like(q))


def attend_written(q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, plan: StepPlan, scale: float,
                   out: torch.Tensor) -> torch.Tensor:
    """The read half of :func:`paged_attention` (K/V already written): fills the rows of ``out``
    of the sequences ``plan`` names and returns it; other rows are left as they are."""
    if plan.batch is not None:
        out[plan.batch.rows] = _attend_decode_batch(q[plan.batch.rows], cache, plan.batch, scale)
    for i in plan.loop:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        q_len, seq_len = end - start, meta.seq_lens[i]
        window = meta.window_of(i)
        if meta.kept_path(i):
            keys = kept_keys(seq_len, q_len, meta.block_size, window, meta.sinks_of(i), meta.dropped_of(i))
            out[start:end], scores = attend_kept(q[start:end], cache, meta.block_tables[i], seq_len, keys, scale,
                                                 meta.scores_of(i))
            if scores is not None:
                acc = meta.block_scores.get(i)
                meta.block_scores[i] = scores if acc is None else acc + scores
            continue
        # With a window, keys before the first query's window are never read: skip them.
        first = 0 if window is None else max(0, seq_len - q_len - window + 1)
        kv = heads_major(gather_context(cache, meta.block_tables[i], seq_len, first), q.dtype)
        whole = window is None or window >= seq_len  # every query sees every earlier key
        if whole and 1 < q_len < seq_len and q.device.type == "cpu":  # a later chunk over its cache
            out[start:end] = _attend_split(q[start:end], kv[0], kv[1], seq_len - q_len, scale)
            continue
        causal = q_len == seq_len > 1 and whole  # a prompt's first chunk
        mask = None if causal else _causal_mask(q_len, seq_len - first, window, q.device)
        out[start:end] = _attend(q[start:end], kv[0], kv[1], mask, scale, causal)
    return out
