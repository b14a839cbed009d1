"""KV storage: every layer's blocks, written and read through codecs, plus a full-precision window.

Bytes
-----
A layer's pool is one tensor. For a float pool (bf16/fp16/fp32 on both sides) it is the classic
``[2, num_blocks, block_size, kv_heads, head_dim]`` (index 0 = K, 1 = V) and attention uses it
directly. For a lossy pool it is ``uint8 [num_blocks, K bytes + V bytes]``: each block's K region
then V region, each holding its codec's fields (:mod:`kvserve.kv.quant`) side by side. On the CPU
the pool tensors are on transparent huge pages (:func:`kvserve.model.huge_pages.empty_on`)::

    block b:  | K: scale fp32 [bs, kvh] | q int8 [bs, kvh, d] | V: scale … | q … |      (int8)

A block records which codec pair wrote it (``block_pair``), so requests with different codecs
(a per-request override) share one pool and one batch: every block is decoded with its own codec.
An override must fit the pool's block (a bf16 pool takes every codec but int4, an int8 pool int8,
fp8 and int4 …).

The window: shadows
-------------------
Lossy pools also hold ``window_blocks`` blocks in the model dtype, ``[2, window, bs, kvh, d]`` per
layer. A *shadow* is one of them attached to a pool block; it holds that block's K and V at full
precision, and reads take the shadow's rows instead of the decoded ones. A block gets a shadow
while

* **short**: the sequence writing it is shorter than ``min_tokens`` (it reads full precision, as
  if unquantized; when it crosses the threshold its shadows go and it reads its quantized blocks —
  which were written all along, so nothing is re-encoded and full blocks are always valid codec
  data, safe to share through the prefix cache);
* **tail** (int4): the block holds an unfinished key group (keys are encoded per channel once the
  group fills, from the shadow);
* **sink** (int4, ``sink_tokens > 0``): it is a sequence's first block; its first ``sink_tokens``
  rows are read from the shadow.

Invariants
----------
* Every written token of a block has valid codec data in the pool, except int4 keys of a block
  that has a shadow and is not full: those live in the shadow until the group is encoded.
* A shadow's rows equal the full-precision K/V written at those positions (or, after an
  unusual "unseal", the decoded values).
* When the window runs out, shadows untouched this step are reclaimed, least recently used first:
  short/sink ones are dropped (reads fall back to the valid codec data); a tail one is *sealed*
  (its keys encoded over the tokens present) first. Sized as :func:`kvserve.kv.layout.window_blocks`,
  the window always covers every running sequence, so only idle holders (parked sessions) lose theirs.
* ``nbytes`` (all tensors) equals :attr:`kvserve.kv.layout.KVCapacity.allocated_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvserve.contract.block_ops import BlockOp, CopyBlock, NoTierConfigured
from kvserve.kv.codec_pairs import CodecPair, CodecPairs, MapPair, field_views
from kvserve.kv.layer_kv import CodecLayerKV, LayerKV, PlainLayerKV, put_blocks
from kvserve.kv.quant import Fields, KVCodecSpec
from kvserve.kv.shadow_window import ShadowWindow
from kvserve.kv.write_plan import PlanBuilder, WritePlan, Writes
from kvserve.model.huge_pages import empty_on


class _Chunk(Protocol):
    """What storage needs of a scheduled chunk (:class:`kvserve.contract.ScheduledChunk`)."""

    @property
    def start(self) -> int: ...

    @property
    def block_ids(self) -> Sequence[int | None]: ...

    @property
    def end(self) -> int: ...


class KVStorage:
    """All layers' KV for one pool. The runner calls :meth:`begin_step` once per step, then hands
    :meth:`layers` to the model; attention calls each layer's ``write`` and ``gather_blocks``."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pool: KVCodecSpec | tuple[KVCodecSpec, ...], group_size: int, window_blocks: int = 0,
                 min_tokens: int = 0, sink_tokens: int = 0, device: torch.device | str = "cpu") -> None:
        if sink_tokens < 0 or sink_tokens > block_size:
            raise ValueError(f"kv_quant_sink_tokens must be in [0, block_size={block_size}], got {sink_tokens}")
        if min_tokens < 0:
            raise ValueError(f"kv_quant_min_tokens must be >= 0, got {min_tokens}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        self.group_size, self.min_tokens, self.sink_tokens = group_size, min_tokens, sink_tokens
        self.device = torch.device(device)
        self.window_blocks = window_blocks
        self.codecs = CodecPairs(pool, block_size=block_size, kv_heads=kv_heads, head_dim=head_dim,
                                 group_size=group_size, sink_tokens=sink_tokens, model_dtype=_dtype_name(dtype))
        self.pairs = self.codecs.pairs  # by id; 0 is the pool's own
        pool_pair = self.pool = self.codecs.pool
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.plain_dtype = _plain_dtype(pool_pair)
        self.plain: list[torch.Tensor] | None = None
        # ``planes[layer]`` is ``uint8 [2, num_blocks, side bytes]`` when K and V regions have one
        # size in that layer (one gather reads both); else None there and K and V are two tensors.
        self.planes: list[torch.Tensor | None] | None = None
        if self.plain_dtype is not None:   # float pool: the classic layout, shared with attention
            self.plain = [empty_on(self.device, (2, *shape), self.plain_dtype) for _ in range(num_layers)]
            self._bufs = list(self.plain)
            self.planes = [t.view(2, num_blocks, -1).view(torch.uint8) for t in self.plain]
        else:
            self._bufs, self.k_regions, self.v_regions = [], [], []
            planes: list[torch.Tensor | None] = []
            for layer in range(num_layers):  # a per-layer pool sizes each layer by its own pair
                kb, vb = self.codecs.regions(layer)
                if kb == vb:
                    plane = empty_on(self.device, (2, num_blocks, kb), torch.uint8)
                    self._bufs.append(plane)
                    planes.append(plane)
                    self.k_regions.append(plane[0])
                    self.v_regions.append(plane[1])
                else:
                    k_buf, v_buf = (empty_on(self.device, (num_blocks, n), torch.uint8) for n in (kb, vb))
                    self._bufs += [k_buf, v_buf]
                    planes.append(None)
                    self.k_regions.append(k_buf)
                    self.v_regions.append(v_buf)
            self.planes = planes if any(p is not None for p in planes) else None  # type: ignore[assignment]
        if self.plain is not None:
            assert self.planes is not None
            self.k_regions = [p[0] for p in self.planes]
            self.v_regions = [p[1] for p in self.planes]
        self.shadows = [torch.empty((2, window_blocks, block_size, kv_heads, head_dim), dtype=dtype,
                                    device=self.device) for _ in range(num_layers)] if window_blocks else []
        # Block state (python lists are the truth; the tensors mirror what reads need).
        self.block_pair = [0] * num_blocks
        self.fill = [0] * num_blocks
        self.pairs_used: set[int] = {0}
        self._block_pair_t = torch.zeros(num_blocks, dtype=torch.int64, device=self.device)
        self.window = ShadowWindow(window_blocks)
        self.shadow_of = self.window.shadow_of  # pool block -> window slot (the window owns it)
        self._has_shadow = torch.zeros(num_blocks, dtype=torch.bool, device=self.device)
        self._shadow_slot = torch.zeros(num_blocks, dtype=torch.int64, device=self.device)
        self._shadow_rows = torch.zeros(num_blocks, dtype=torch.int64, device=self.device)
        self._unneeded: set[int] = set()
        self._views: dict[tuple[int, int, str], Fields] = {}
        self.step_no = 0
        self.plan: WritePlan | None = None
        self._layers = [CodecLayerKV(self, i) for i in range(num_layers)]
        self._plain_layers = [PlainLayerKV(t) for t in self.plain] if self.plain is not None else None

    # -- codecs ------------------------------------------------------------------------------
    def layer_pair(self, layer: int, pid: int) -> CodecPair:
        """The pair that encodes and decodes layer ``layer`` of blocks written by pair ``pid``
        (differs by layer only for pid 0 of a per-layer pool)."""
        return self.codecs.layer_pair(layer, pid)

    def pair_for(self, spec: str | KVCodecSpec | None) -> int:
        """The codec pair id for a request's ``kv_cache_dtype`` (None = the pool's); see
        :meth:`kvserve.kv.codec_pairs.CodecPairs.pair_for`."""
        return self.codecs.pair_for(spec)

    # -- bytes -------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self._bufs, *self.shadows])

    @property
    def window_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shadows)

    # -- per step ------------------------------------------------------------------------------
    def layers(self) -> list[LayerKV]:
        """What the model gets per layer: the plain tensors while every block is the float pool's
        own codec (the classic fast path), else codec-aware layer views."""
        if self._plain_layers is not None and self.pairs_used == {0}:
            return self._plain_layers  # type: ignore[return-value]
        return self._layers  # type: ignore[return-value]

    def run_block_ops(self, ops: Sequence[BlockOp]) -> None:
        """Run a step's block operations in order, before its forward. Only ``CopyBlock`` has an
        endpoint today; the others need a tier or a peer (the tiers issue) and are refused."""
        for op in ops:
            if isinstance(op, CopyBlock):
                self._copy_block(op.src, op.dst)
            else:
                raise NoTierConfigured(f"{type(op).__name__} needs a KV tier or peer, and none is configured "
                                       f"(only copy runs without one)")

    def begin_step(self, chunks: Sequence[_Chunk], codecs: Sequence[str | None] | None = None) -> WritePlan:
        """Update block state and shadows for this step's chunks (``codecs[i]``: chunk i's KV codec,
        None for the pool's own), and build the write plan every layer follows. Chunks are in
        batch order; block operations ran before (:meth:`run_block_ops`)."""
        self.step_no += 1
        pb = PlanBuilder()
        bs = self.block_size
        row0 = 0
        for c, codec in zip(chunks, codecs or [None] * len(chunks)):
            pid = self.pair_for(codec)
            self.pairs_used.add(pid)
            short = self._is_short(pid, c.end)
            if self.pairs[pid].lossy and not short and c.start < self.min_tokens:
                self._cross(c, pid)
            table = c.block_ids
            for i in range(c.start // bs, (c.end - 1) // bs + 1):
                b = table[i]
                assert b is not None, "a step never writes into a dropped block"
                lo = max(c.start, i * bs) - i * bs
                hi = min(c.end, (i + 1) * bs) - i * bs
                if lo == 0:
                    self.restart_block(b, pid)
                pair = self.pairs[self.block_pair[b]]
                slot = self._shadow_for_block(b, i, lo, hi, pair, short)
                first_row = row0 + (i * bs + lo - c.start)
                w = pb.writes.setdefault(self.block_pair[b], Writes())
                n = hi - lo  # the run of rows first_row.. goes to offsets lo..hi-1 of block b
                w.rows.extend(range(first_row, first_row + n))
                w.blocks.extend([b] * n)
                w.offsets.extend(range(lo, hi))
                if slot is not None:
                    pb.sh_rows.extend(range(first_row, first_row + n))
                    pb.sh_slots.extend([slot] * n)
                    pb.sh_offs.extend(range(lo, hi))
                if pair.k_grouped and hi == bs:
                    if slot is None:  # the whole block is in this step's batch
                        d = pb.direct.setdefault(self.block_pair[b], ([], []))
                        d[0].append(b)
                        d[1].append(first_row)
                    else:
                        s = pb.from_shadow.setdefault(self.block_pair[b], ([], []))
                        s[0].append(b)
                        s[1].append(slot)
                        self._set_flags(b, tail=False)
                self.fill[b] = hi
            if short:
                self._touch_table(table, c.end)
            row0 += c.end - c.start
        self.plan = pb.build(self.device)
        return self.plan

    def _is_short(self, pid: int, end: int) -> bool:
        return self.pairs[pid].lossy and self.window_blocks > 0 and end < self.min_tokens

    # -- block state -------------------------------------------------------------------------
    def restart_block(self, b: int, pid: int) -> None:
        """Block ``b`` gets new contents from offset 0 (it was free): it takes the writer's codec,
        and a shadow left by its previous contents goes at once."""
        if b in self.shadow_of:
            self._drop(b)
        self.fill[b] = 0
        if self.block_pair[b] != pid:
            self.block_pair[b] = pid
            self._block_pair_t[b] = pid

    def _shadow_for_block(self, b: int, index: int, lo: int, hi: int, pair: CodecPair | MapPair,
                          short: bool) -> int | None:
        """Give block ``b`` (the ``index``-th of its sequence, written at offsets lo..hi-1) the
        shadow it needs this step, if any; returns its slot. (A per-layer pool's shadow holds every
        layer; layers without int4 then read those rows exact too.)"""
        tail = pair.k_grouped and hi < self.block_size
        sink = pair.sinks and index == 0
        unseal = pair.k_grouped and lo > 0 and b not in self.shadow_of
        if not (short or tail or sink or unseal):
            return self.shadow_of.get(b)
        if b not in self.shadow_of:
            slot = self._allocate(b)
            if unseal:
                self._unseal(b, slot)
        self._set_flags(b, short=short or None, tail=tail or None, sink=sink or None)
        return self.shadow_of[b]

    def _set_flags(self, b: int, short: bool | None = None, tail: bool | None = None,
                   sink: bool | None = None) -> None:
        slot = self.shadow_of.get(b)
        if slot is None:
            return
        s = self.window.at(slot)
        if short is not None:
            s.short = short
        if tail is not None:
            s.tail = tail
        if sink is not None:
            s.sink = sink
        s.last_step = self.step_no
        if not s.needed:
            self._unneeded.add(b)
        rows = self.block_size if (s.short or s.tail or not s.sink) else self.sink_tokens
        self._shadow_rows[b] = rows

    def _cross(self, c: _Chunk, pid: int) -> None:
        """The sequence reaches ``min_tokens`` this step: its short shadows go (reads use the codec
        data written all along); an int4 tail or sink stays."""
        for b in c.block_ids[: -(-c.start // self.block_size)]:
            if b is not None and b in self.shadow_of:
                self._set_flags(b, short=False)

    def _touch_table(self, table: Sequence[int | None], end: int) -> None:
        for b in table[: -(-end // self.block_size)]:
            s = None if b is None else self.window.get(b)
            if s is not None:
                s.last_step = self.step_no

    def _allocate(self, b: int) -> int:
        if self.window.full:
            self._reclaim()
        slot = self.window.allocate(b, self.step_no)
        self._has_shadow[b] = True
        self._shadow_slot[b] = slot
        self._shadow_rows[b] = self.block_size
        return slot

    def _reclaim(self) -> None:
        """Free one slot: an unneeded shadow, else the least recently used one untouched this step
        (a tail is sealed first). Raises if every shadow is in use by this step."""
        s = self.window.victim(self.step_no)
        if s is None:
            raise RuntimeError(f"the full-precision KV window ({self.window_blocks} blocks) is exhausted by "
                               f"this step's sequences; raise kv_cache_memory or lower max_num_seqs")
        if s.tail and self.fill[s.block] < self.block_size:
            self._seal(s.block, self.shadow_of[s.block])
        self._drop(s.block)

    def _drop(self, b: int) -> None:
        self.window.drop(b)
        self._has_shadow[b] = False

    def end_step(self) -> None:
        """Return the slots of shadows no longer needed. Called after the forward, so a slot is
        never reused inside the step that finished with it."""
        for b in self._unneeded:
            s = self.window.get(b)
            if s is not None and not s.needed:
                self._drop(b)
        self._unneeded.clear()
        self.plan = None

    def _pair_views(self, layer: int, pid: int, side: str) -> Fields:
        key = (layer, pid, side)
        if key not in self._views:
            pair = self.codecs.layer_pair(layer, pid)
            region = self.k_regions[layer] if side == "k" else self.v_regions[layer]
            self._views[key] = field_views(region, pair.k_fields if side == "k" else pair.v_fields)
        return self._views[key]

    def _seal(self, b: int, slot: int) -> None:
        """Encode the int4 keys of partial block ``b`` over its present tokens (from the shadow)."""
        n = torch.tensor([self.fill[b]], device=self.device)
        for layer in range(self.num_layers):
            pair = self.codecs.layer_pair(layer, self.block_pair[b])
            if not pair.k.grouped:  # a per-layer pool's other layers wrote their keys per token
                continue
            fields = pair.k.encode_blocks(self.shadows[layer][0, slot:slot + 1], n)
            put_blocks(self._pair_views(layer, self.block_pair[b], "k"), fields, torch.tensor([b], device=self.device))

    def _unseal(self, b: int, slot: int) -> None:
        """A sealed partial block gets a shadow again: start it from the decoded values."""
        ids = torch.tensor([b], device=self.device)
        for layer in range(self.num_layers):
            self.shadows[layer][:, slot] = self._layers[layer].decode_blocks(ids)[:, 0]

    def _copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: ``dst`` gets ``src``'s bytes, codec, fill and (a copy of) its shadow."""
        for layer in range(self.num_layers):
            self.k_regions[layer][dst] = self.k_regions[layer][src]
            self.v_regions[layer][dst] = self.v_regions[layer][src]
        self.restart_block(dst, self.block_pair[src])
        self.fill[dst] = self.fill[src]
        s = self.window.get(src)
        if s is not None:
            slot = self.shadow_of[src]
            new = self._allocate(dst)
            for layer in range(self.num_layers):
                self.shadows[layer][:, new] = self.shadows[layer][:, slot]
            self._set_flags(dst, short=s.short, tail=s.tail, sink=s.sink)

    # -- checks ------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the shadow bookkeeping is consistent (slots, maps and mirror tensors agree)."""
        self.window.check()
        assert int(self._has_shadow.sum()) == len(self.shadow_of)
        for b, slot in self.shadow_of.items():
            assert int(self._shadow_slot[b]) == slot

    @property
    def num_shadows(self) -> int:
        return len(self.shadow_of)


def _plain_dtype(pair: CodecPair | MapPair) -> torch.dtype | None:
    from kvserve.kv.quant import IdentityCodec

    if isinstance(pair, MapPair):
        return None
    if isinstance(pair.k, IdentityCodec) and isinstance(pair.v, IdentityCodec) and pair.k.dtype == pair.v.dtype:
        return pair.k.dtype
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]


