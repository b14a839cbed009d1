"""KV storage: every layer's blocks, written and read through codecs, plus a full-precision window.

Bytes
-----
A layer's pool is one tensor. For a float pool (bf16/fp16/fp32 on both sides) it is the classic
``[2, num_blocks, block_size, kv_heads, head_dim]`` (index 0 = K, 1 = V) and attention uses it
directly. For a lossy pool it is ``uint8 [num_blocks, K bytes + V bytes]``: each block's K region
then V region, each holding its codec's fields (:mod:`kvserve.kv.quant`) side by side::

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
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.kv.quant import Codec, Fields, FieldSpec, KVCodecSpec, make_codec, parse_kv_codecs


class _Chunk(Protocol):
    """What storage needs of a scheduled chunk (``kvserve.scheduler.output.ScheduledChunk``)."""

    @property
    def start(self) -> int: ...

    @property
    def block_table(self) -> tuple[int, ...]: ...

    @property
    def end(self) -> int: ...

    @property
    def request(self) -> object: ...


@dataclass(frozen=True)
class CodecPair:
    """The K and V codecs of one spec, with where their fields sit in a block's regions."""

    spec: KVCodecSpec
    k: Codec
    v: Codec
    k_fields: tuple[tuple[FieldSpec, int], ...]  # (field, byte offset in the K region)
    v_fields: tuple[tuple[FieldSpec, int], ...]
    sinks: bool  # first tokens of a sequence read from a shadow
    joint: bool  # K and V use one codec with one field layout: decoded in one call

    @property
    def lossy(self) -> bool:
        return self.spec.lossy


def _place(fields: tuple[FieldSpec, ...]) -> tuple[tuple[FieldSpec, int], ...]:
    """Widest element first, so each field starts aligned to its element size."""
    out, off = [], 0
    for f in sorted(fields, key=lambda f: -f.dtype.itemsize):
        out.append((f, off))
        off += f.nbytes
    return tuple(out)


def _field_views(region: torch.Tensor, placed: tuple[tuple[FieldSpec, int], ...]) -> Fields:
    """Typed views ``[rows, *field.shape]`` of a ``uint8 [rows, region bytes]`` tensor."""
    rows = region.shape[0]
    return {f.name: region[:, off:off + f.nbytes].view(f.dtype).view(rows, *f.shape) for f, off in placed}


@dataclass
class _Shadow:
    block: int
    short: bool = False
    tail: bool = False
    sink: bool = False
    last_step: int = 0

    @property
    def needed(self) -> bool:
        return self.short or self.tail or self.sink


@dataclass
class _Writes:
    """Per codec pair: token ``rows`` of the step's batch go to (``blocks``, ``offsets``)."""

    rows: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _TokenWrite:
    rows: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor
    all_rows: bool  # rows == 0..T-1: index nothing


@dataclass(frozen=True)
class _Finalize:
    """Blocks whose int4 key groups are encoded this step, from batch rows or from shadow slots."""

    blocks: torch.Tensor
    first_rows: torch.Tensor | None  # direct: rows first_rows + 0..bs-1 of the batch
    slots: torch.Tensor | None       # else: from these shadow slots


@dataclass(frozen=True)
class StepPlan:
    """Everything a layer needs to write this step's tokens; the same for every layer."""

    writes: dict[int, _TokenWrite]
    shadow_rows: torch.Tensor | None
    shadow_slots: torch.Tensor | None
    shadow_offsets: torch.Tensor | None
    finalize: list[tuple[int, _Finalize]]


class KVStorage:
    """All layers' KV for one pool. The runner calls :meth:`begin_step` once per step, then hands
    :meth:`layers` to the model; attention calls each layer's ``write`` and ``gather_blocks``."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pool: KVCodecSpec, group_size: int, window_blocks: int = 0,
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
        self.pairs: list[CodecPair] = []
        self._pair_ids: dict[str, int] = {}
        pool_pair = self.pairs[self._add_pair(pool)]
        self.pool = pool_pair
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.plain_dtype = _plain_dtype(pool_pair)
        self.plain: list[torch.Tensor] | None = None
        # ``planes[layer]`` is ``uint8 [2, num_blocks, side bytes]`` when K and V regions have one
        # size (one gather reads both); else K and V are two tensors.
        self.planes: list[torch.Tensor] | None = None
        if self.plain_dtype is not None:   # float pool: the classic layout, shared with attention
            self.plain = [torch.empty((2, *shape), dtype=self.plain_dtype, device=self.device)
                          for _ in range(num_layers)]
            self._bufs = list(self.plain)
            self.planes = [t.view(2, num_blocks, -1).view(torch.uint8) for t in self.plain]
        else:
            kb, vb = self._region_bytes(pool_pair)
            if kb == vb:
                self._bufs = [torch.empty((2, num_blocks, kb), dtype=torch.uint8, device=self.device)
                              for _ in range(num_layers)]
                self.planes = list(self._bufs)
            else:
                self._bufs = [torch.empty((num_blocks, n), dtype=torch.uint8, device=self.device)
                              for _ in range(num_layers) for n in (kb, vb)]
        if self.planes is not None:
            self.k_regions = [p[0] for p in self.planes]
            self.v_regions = [p[1] for p in self.planes]
        else:
            self.k_regions, self.v_regions = self._bufs[0::2], self._bufs[1::2]
        self.shadows = [torch.empty((2, window_blocks, block_size, kv_heads, head_dim), dtype=dtype,
                                    device=self.device) for _ in range(num_layers)] if window_blocks else []
        # Block state (python lists are the truth; the tensors mirror what reads need).
        self.block_pair = [0] * num_blocks
        self.fill = [0] * num_blocks
        self.pairs_used: set[int] = {0}
        self._block_pair_t = torch.zeros(num_blocks, dtype=torch.int64, device=self.device)
        self.shadow_of: dict[int, int] = {}
        self._slots: list[_Shadow | None] = [None] * window_blocks
        self._free_slots = list(range(window_blocks - 1, -1, -1))
        self._has_shadow = torch.zeros(num_blocks, dtype=torch.bool, device=self.device)
        self._shadow_slot = torch.zeros(num_blocks, dtype=torch.int64, device=self.device)
        self._shadow_rows = torch.zeros(num_blocks, dtype=torch.int64, device=self.device)
        self._unneeded: set[int] = set()
        self._views: dict[tuple[int, int, str], Fields] = {}
        self.step_no = 0
        self.plan: StepPlan | None = None
        self._layers = [LayerKV(self, i) for i in range(num_layers)]

    # -- codecs ------------------------------------------------------------------------------
    @property
    def kv_regions_bytes(self) -> tuple[int, int]:
        return self.k_regions[0].shape[1], self.v_regions[0].shape[1]

    def _region_bytes(self, pair: CodecPair) -> tuple[int, int]:
        args = (self.block_size, self.kv_heads, self.head_dim)
        return pair.k.block_bytes(*args), pair.v.block_bytes(*args)

    def _add_pair(self, spec: KVCodecSpec) -> int:
        if spec.name in self._pair_ids:
            return self._pair_ids[spec.name]
        k = make_codec(spec.k, "k", self.group_size)
        v = make_codec(spec.v, "v", self.group_size)
        args = (self.block_size, self.kv_heads, self.head_dim)
        kf, vf = _place(k.fields(*args)), _place(v.fields(*args))
        pair = CodecPair(spec, k, v, kf, vf, sinks=self.sink_tokens > 0 and "int4" in (spec.k, spec.v),
                         joint=spec.k == spec.v and not k.grouped and kf == vf)
        self.pairs.append(pair)
        self._pair_ids[spec.name] = len(self.pairs) - 1
        return len(self.pairs) - 1

    def pair_for(self, spec: str | KVCodecSpec | None) -> int:
        """The id of a codec pair for a request's ``kv_cache_dtype`` (``None`` = the pool's), checking
        that it fits this pool. Raises ValueError naming what does fit."""
        if spec is None:
            return 0
        parsed = spec if isinstance(spec, KVCodecSpec) else parse_kv_codecs(spec, _dtype_name(self.dtype))
        if parsed.name in self._pair_ids:
            return self._pair_ids[parsed.name]
        k = make_codec(parsed.k, "k", self.group_size)
        v = make_codec(parsed.v, "v", self.group_size)
        args = (self.block_size, self.kv_heads, self.head_dim)
        kb, vb = self.kv_regions_bytes
        if k.block_bytes(*args) > kb or v.block_bytes(*args) > vb:
            raise ValueError(f"kv_cache_dtype {parsed.name!r} needs more bytes per block than this engine's "
                             f"{self.pool.spec.name!r} pool holds; use a codec no wider than the pool's")
        needs_window = k.grouped or (self.sink_tokens > 0 and "int4" in (parsed.k, parsed.v))
        if needs_window and not (self.pool.k.grouped or self.pool.sinks):
            raise ValueError(f"kv_cache_dtype {parsed.name!r} keeps unfinished int4 key groups or sink "
                             f"tokens in full precision, which needs an engine whose kv_cache_dtype uses int4")
        return self._add_pair(parsed)

    # -- bytes -------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self._bufs, *self.shadows])

    @property
    def window_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shadows)

    # -- per step ------------------------------------------------------------------------------
    def layers(self) -> list[torch.Tensor] | list[LayerKV]:
        """What the model gets per layer: the plain tensors while every block is the float pool's
        own codec (the classic fast path), else codec-aware layer views."""
        if self.plain is not None and self.pairs_used == {0}:
            return self.plain
        return self._layers

    def begin_step(self, chunks: Sequence[_Chunk], copies: Sequence[tuple[int, int]] = ()) -> StepPlan:
        """Apply copy-on-write copies, update block state and shadows for this step's chunks, and
        build the write plan every layer follows. Chunks are in batch order."""
        self.step_no += 1
        for src, dst in copies:
            self._copy_block(src, dst)
        writes: dict[int, _Writes] = {}
        sh_rows: list[int] = []
        sh_slots: list[int] = []
        sh_offs: list[int] = []
        direct: dict[int, tuple[list[int], list[int]]] = {}
        from_shadow: dict[int, tuple[list[int], list[int]]] = {}
        bs = self.block_size
        row0 = 0
        for c in chunks:
            pid = self.pair_for(getattr(c.request, "kv_cache_dtype", None))
            self.pairs_used.add(pid)
            short = self._is_short(pid, c.end)
            if self.pairs[pid].lossy and not short and c.start < self.min_tokens:
                self._cross(c, pid)
            table = c.block_table
            for i in range(c.start // bs, (c.end - 1) // bs + 1):
                b = table[i]
                lo = max(c.start, i * bs) - i * bs
                hi = min(c.end, (i + 1) * bs) - i * bs
                if lo == 0:
                    self._restart(b, pid)
                pair = self.pairs[self.block_pair[b]]
                slot = self._shadow_for_block(b, i, lo, hi, pair, short)
                first_row = row0 + (i * bs + lo - c.start)
                w = writes.setdefault(self.block_pair[b], _Writes())
                for off in range(lo, hi):
                    w.rows.append(first_row + off - lo)
                    w.blocks.append(b)
                    w.offsets.append(off)
                    if slot is not None:
                        sh_rows.append(first_row + off - lo)
                        sh_slots.append(slot)
                        sh_offs.append(off)
                if pair.k.grouped and hi == bs:
                    if slot is None:  # the whole block is in this step's batch
                        d = direct.setdefault(self.block_pair[b], ([], []))
                        d[0].append(b)
                        d[1].append(first_row)
                    else:
                        s = from_shadow.setdefault(self.block_pair[b], ([], []))
                        s[0].append(b)
                        s[1].append(slot)
                        self._set_flags(b, tail=False)
                self.fill[b] = hi
            if short:
                self._touch_table(table, c.end)
            row0 += c.end - c.start
        self.plan = self._build_plan(writes, sh_rows, sh_slots, sh_offs, direct, from_shadow)
        return self.plan

    def _is_short(self, pid: int, end: int) -> bool:
        return self.pairs[pid].lossy and self.window_blocks > 0 and end < self.min_tokens

    def _build_plan(self, writes: dict[int, _Writes], sh_rows: list[int], sh_slots: list[int],
                    sh_offs: list[int], direct: dict[int, tuple[list[int], list[int]]],
                    from_shadow: dict[int, tuple[list[int], list[int]]]) -> StepPlan:
        dev = self.device

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=dev)

        total = sum(len(w.rows) for w in writes.values())
        token_writes = {pid: _TokenWrite(t(w.rows), t(w.blocks), t(w.offsets), w.rows == list(range(total)))
                        for pid, w in writes.items()}
        finalize = [(pid, _Finalize(t(b), t(r), None)) for pid, (b, r) in direct.items()]
        finalize += [(pid, _Finalize(t(b), None, t(s))) for pid, (b, s) in from_shadow.items()]
        if sh_rows:
            return StepPlan(token_writes, t(sh_rows), t(sh_slots), t(sh_offs), finalize)
        return StepPlan(token_writes, None, None, None, finalize)

    # -- block state -------------------------------------------------------------------------
    def _restart(self, b: int, pid: int) -> None:
        """Block ``b`` gets new contents from offset 0 (it was free): it takes the writer's codec,
        and a shadow left by its previous contents goes at once."""
        if b in self.shadow_of:
            self._drop(b)
        self.fill[b] = 0
        if self.block_pair[b] != pid:
            self.block_pair[b] = pid
            self._block_pair_t[b] = pid

    def _shadow_for_block(self, b: int, index: int, lo: int, hi: int, pair: CodecPair, short: bool) -> int | None:
        """Give block ``b`` (the ``index``-th of its sequence, written at offsets lo..hi-1) the
        shadow it needs this step, if any; returns its slot."""
        tail = pair.k.grouped and hi < self.block_size
        sink = pair.sinks and index == 0
        unseal = pair.k.grouped and lo > 0 and b not in self.shadow_of
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
        s = self._slots[slot]
        assert s is not None
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
        for b in c.block_table[: -(-c.start // self.block_size)]:
            if b in self.shadow_of:
                self._set_flags(b, short=False)

    def _touch_table(self, table: tuple[int, ...], end: int) -> None:
        for b in table[: -(-end // self.block_size)]:
            slot = self.shadow_of.get(b)
            if slot is not None:
                s = self._slots[slot]
                assert s is not None
                s.last_step = self.step_no

    def _allocate(self, b: int) -> int:
        if not self._free_slots:
            self._reclaim()
        slot = self._free_slots.pop()
        self._slots[slot] = _Shadow(b, last_step=self.step_no)
        self.shadow_of[b] = slot
        self._has_shadow[b] = True
        self._shadow_slot[b] = slot
        self._shadow_rows[b] = self.block_size
        return slot

    def _reclaim(self) -> None:
        """Free one slot: an unneeded shadow, else the least recently used one untouched this step
        (a tail is sealed first). Raises if every shadow is in use by this step."""
        best: tuple[int, int] | None = None  # (key, slot)
        for slot, s in enumerate(self._slots):
            if s is None or s.last_step == self.step_no:  # this step may still read or finalize it
                continue
            key = -1 if not s.needed else s.last_step
            if best is None or key < best[0]:
                best = (key, slot)
        if best is None:
            raise RuntimeError(f"the full-precision KV window ({self.window_blocks} blocks) is exhausted by "
                               f"this step's sequences; raise kv_cache_memory or lower max_num_seqs")
        s = self._slots[best[1]]
        assert s is not None
        if s.tail and self.fill[s.block] < self.block_size:
            self._seal(s.block, best[1])
        self._drop(s.block)

    def _drop(self, b: int) -> None:
        slot = self.shadow_of.pop(b)
        self._slots[slot] = None
        self._free_slots.append(slot)
        self._has_shadow[b] = False

    def end_step(self) -> None:
        """Return the slots of shadows no longer needed. Called after the forward, so a slot is
        never reused inside the step that finished with it."""
        for b in self._unneeded:
            slot = self.shadow_of.get(b)
            if slot is not None and not self._slots[slot].needed:  # type: ignore[union-attr]
                self._drop(b)
        self._unneeded.clear()
        self.plan = None

    def _pair_views(self, layer: int, pid: int, side: str) -> Fields:
        key = (layer, pid, side)
        if key not in self._views:
            pair = self.pairs[pid]
            region = self.k_regions[layer] if side == "k" else self.v_regions[layer]
            self._views[key] = _field_views(region, pair.k_fields if side == "k" else pair.v_fields)
        return self._views[key]

    def _seal(self, b: int, slot: int) -> None:
        """Encode the int4 keys of partial block ``b`` over its present tokens (from the shadow)."""
        pair = self.pairs[self.block_pair[b]]
        n = torch.tensor([self.fill[b]], device=self.device)
        for layer in range(self.num_layers):
            fields = pair.k.encode_blocks(self.shadows[layer][0, slot:slot + 1], n)
            _put_blocks(self._pair_views(layer, self.block_pair[b], "k"), fields, torch.tensor([b], device=self.device))

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
        self._restart(dst, self.block_pair[src])
        self.fill[dst] = self.fill[src]
        slot = self.shadow_of.get(src)
        if slot is not None:
            s = self._slots[slot]
            assert s is not None
            new = self._allocate(dst)
            for layer in range(self.num_layers):
                self.shadows[layer][:, new] = self.shadows[layer][:, slot]
            self._set_flags(dst, short=s.short, tail=s.tail, sink=s.sink)

    # -- checks ------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the shadow bookkeeping is consistent (slots, maps and mirror tensors agree)."""
        used = {slot for slot, s in enumerate(self._slots) if s is not None}
        assert used.isdisjoint(self._free_slots) and len(used) + len(self._free_slots) == self.window_blocks
        assert {self._slots[s].block: s for s in used} == self.shadow_of  # type: ignore[union-attr]
        assert int(self._has_shadow.sum()) == len(self.shadow_of)
        for b, slot in self.shadow_of.items():
            assert int(self._shadow_slot[b]) == slot

    @property
    def num_shadows(self) -> int:
        return len(self.shadow_of)


def _put_tokens(views: Fields, fields: Fields, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    for name, value in fields.items():
        views[name].index_put_((blocks, offsets), value)


def _put_blocks(views: Fields, fields: Fields, blocks: torch.Tensor) -> None:
    for name, value in fields.items():
        views[name].index_put_((blocks,), value)


def _plain_dtype(pair: CodecPair) -> torch.dtype | None:
    from kvserve.kv.quant import IdentityCodec

    if isinstance(pair.k, IdentityCodec) and isinstance(pair.v, IdentityCodec) and pair.k.dtype == pair.v.dtype:
        return pair.k.dtype
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]


class LayerKV:
    """One layer's view of :class:`KVStorage`, what attention receives instead of a plain tensor.

    ``shape`` mimics the plain ``[2, num_blocks, block_size, kv_heads, head_dim]`` so attention's
    planning code works unchanged; ``write`` stores a step's K/V (encoding on the way in);
    ``gather_blocks`` decodes only the blocks asked for (fused gather + dequantize) and lays the
    shadows' full-precision rows over them."""

    def __init__(self, storage: KVStorage, layer: int) -> None:
        self.storage = storage
        self.layer = layer

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        s = self.storage
        return (2, s.num_blocks, s.block_size, s.kv_heads, s.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    # -- writing -----------------------------------------------------------------------------
    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor | None = None) -> None:
        """Store this step's keys/values ``[T, kv_heads, head_dim]`` as :meth:`KVStorage.begin_step` planned."""
        s, plan = self.storage, self.storage.plan
        if plan is None:
            raise RuntimeError("KVStorage.begin_step must run before a layer writes")
        for pid, w in plan.writes.items():
            pair = s.pairs[pid]
            kw, vw = (k, v) if w.all_rows else (k[w.rows], v[w.rows])
            if pair.joint:  # one encode for K and V together
                both = pair.k.encode_tokens(torch.cat((kw, vw)))
                n = kw.shape[0]
                _put_tokens(s._pair_views(self.layer, pid, "k"), {f: t[:n] for f, t in both.items()}, w.blocks, w.offsets)
                _put_tokens(s._pair_views(self.layer, pid, "v"), {f: t[n:] for f, t in both.items()}, w.blocks, w.offsets)
                continue
            if not pair.k.grouped:
                _put_tokens(s._pair_views(self.layer, pid, "k"), pair.k.encode_tokens(kw), w.blocks, w.offsets)
            _put_tokens(s._pair_views(self.layer, pid, "v"), pair.v.encode_tokens(vw), w.blocks, w.offsets)
        if plan.shadow_rows is not None:
            shadow = s.shadows[self.layer]
            shadow[0].index_put_((plan.shadow_slots, plan.shadow_offsets), k[plan.shadow_rows].to(s.dtype))
            shadow[1].index_put_((plan.shadow_slots, plan.shadow_offsets), v[plan.shadow_rows].to(s.dtype))
        for pid, f in plan.finalize:
            pair = s.pairs[pid]
            if f.first_rows is not None:
                rows = f.first_rows[:, None] + torch.arange(s.block_size, device=k.device)
                x = k[rows]                                             # [m, bs, kvh, d]
            else:
                assert f.slots is not None
                x = s.shadows[self.layer][0].index_select(0, f.slots)
            _put_blocks(s._pair_views(self.layer, pid, "k"), pair.k.encode_blocks(x), f.blocks)

    # -- reading -----------------------------------------------------------------------------
    def decode_blocks(self, ids: torch.Tensor) -> torch.Tensor:
        """Decode blocks ``ids [M]`` from the pool (no shadows): ``[2, M, bs, kvh, d]`` (K, V)."""
        s = self.storage
        m = ids.numel()
        tail = (s.block_size, s.kv_heads, s.head_dim)
        single = next(iter(s.pairs_used)) if len(s.pairs_used) == 1 else None
        if s.planes is not None:
            raw = s.planes[self.layer].index_select(1, ids)              # [2, M, side bytes]: one gather
            if single is not None and s.pairs[single].joint:
                return self._decode(raw.view(2 * m, -1), single, "k").view(2, m, *tail)
            sides = (raw[0], raw[1])
        else:
            sides = (s.k_regions[self.layer].index_select(0, ids), s.v_regions[self.layer].index_select(0, ids))
        out = torch.empty((2, m, *tail), dtype=s.dtype, device=ids.device)
        if single is not None:
            out[0] = self._decode(sides[0], single, "k")
            out[1] = self._decode(sides[1], single, "v")
            return out
        pids = s._block_pair_t.index_select(0, ids)
        for pid in pids.unique().tolist():
            sel = (pids == pid).nonzero().squeeze(1)
            out[0, sel] = self._decode(sides[0].index_select(0, sel), pid, "k")
            out[1, sel] = self._decode(sides[1].index_select(0, sel), pid, "v")
        return out

    def _decode(self, raw: torch.Tensor, pid: int, side: str) -> torch.Tensor:
        pair = self.storage.pairs[pid]
        codec, placed = (pair.k, pair.k_fields) if side == "k" else (pair.v, pair.v_fields)
        return codec.decode(_field_views(raw, placed), self.storage.dtype)

    def gather_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``block_ids`` (any shape ``[*ids]``) in the model dtype: ``[2, *ids, bs, kvh, d]``."""
        s = self.storage
        ids = block_ids.reshape(-1)
        tail = (s.block_size, s.kv_heads, s.head_dim)
        if s.shadow_of:
            has = s._has_shadow.index_select(0, ids)
            if bool(has.all()) and bool((s._shadow_rows.index_select(0, ids) == s.block_size).all()):
                # Every block read at full precision (a short sequence): no decode at all.
                slots = s._shadow_slot.index_select(0, ids)
                return s.shadows[self.layer].index_select(1, slots).view(2, *block_ids.shape, *tail)
            out = self.decode_blocks(ids)                               # [2, M, bs, kvh, d]
            if bool(has.any()):
                sel = has.nonzero().squeeze(1)
                blocks = ids.index_select(0, sel)
                slots = s._shadow_slot.index_select(0, blocks)
                rows = s._shadow_rows.index_select(0, blocks)
                sub = s.shadows[self.layer].index_select(1, slots)       # [2, r, bs, kvh, d]
                keep = torch.arange(s.block_size, device=ids.device)[None, :] < rows[:, None]
                out.index_copy_(1, sel, torch.where(keep[None, :, :, None, None], sub, out.index_select(1, sel)))
            return out.view(2, *block_ids.shape, *tail)
        return self.decode_blocks(ids).view(2, *block_ids.shape, *tail)

    def gather(self, block_table: torch.Tensor, seq_len: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's keys and values at positions ``first … seq_len - 1``, each ``[n, kvh, d]``."""
        bs = self.storage.block_size
        b0, n_blocks = first // bs, -(-seq_len // bs)
        blocks = self.gather_blocks(block_table[b0:n_blocks])
        off = first - b0 * bs
        kv = blocks.view(2, (n_blocks - b0) * bs, *blocks.shape[-2:])[:, off:seq_len - b0 * bs]
        return kv[0], kv[1]
