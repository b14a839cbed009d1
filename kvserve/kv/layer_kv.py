"""One layer's KV as attention sees it: the :class:`LayerKV` protocol and its two implementations.

``PlainLayerKV`` wraps a float pool's tensor ``[2, num_blocks, block_size, kv_heads, head_dim]``
(index 0 = K); ``CodecLayerKV`` is a view of a codec pool (fp8/int8/int4) that encodes on write and
decodes only the blocks asked for. Attention backends call ``write`` and ``gather_blocks`` and read
``shape``/``dtype``; they never ask which kind they hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from kvserve.kv.codec_pairs import CodecPair, field_views
from kvserve.kv.quant import Fields
from kvserve.native.fused import int8_write

if TYPE_CHECKING:
    from kvserve.kv.storage import KVStorage


class LayerKV(Protocol):
    """A layer's paged KV. ``shape`` is ``(2, num_blocks, block_size, kv_heads, head_dim)``."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store this step's keys/values ``[T, kv_heads, head_dim]`` at their slots."""
        ...

    def gather_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``block_ids`` (any shape ``[*ids]``) in the model dtype: ``[2, *ids, bs, kvh, d]``."""
        ...


class PlainLayerKV:
    """A float pool's layer tensor, used as it is (the fast path: no codec, no copy on write)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        cache = self.tensor
        flat = cache.view(2, cache.shape[1] * cache.shape[2], *cache.shape[3:])
        flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
        flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))

    def gather_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """A copy of the blocks: ``index_select`` over whole flattened blocks (contiguous rows) is
        ~5x faster on CPU than advanced indexing ``cache[:, ids]``."""
        cache = self.tensor
        rows = cache.view(2, cache.shape[1], -1).index_select(1, block_ids.reshape(-1))
        return rows.view(2, *block_ids.shape, *cache.shape[2:])


def as_layer_kv(cache: torch.Tensor | LayerKV) -> LayerKV:
    """A bare tensor (tests, tools) becomes a :class:`PlainLayerKV`."""
    return PlainLayerKV(cache) if isinstance(cache, torch.Tensor) else cache


def put_tokens(views: Fields, fields: Fields, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    for name, value in fields.items():
        views[name].index_put_((blocks, offsets), value)


def put_blocks(views: Fields, fields: Fields, blocks: torch.Tensor) -> None:
    for name, value in fields.items():
        views[name].index_put_((blocks,), value)


class CodecLayerKV:
    """One layer's view of a codec :class:`~kvserve.kv.storage.KVStorage`.

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
            pair = s.layer_pair(self.layer, pid)
            kw, vw = (k, v) if w.all_rows else (k[w.rows], v[w.rows])
            if pair.joint and pair.k.name == "int8" and s.device.type == "cpu" and \
                    int8_write(kw.contiguous(), s._pair_views(self.layer, pid, "k"), w.blocks, w.offsets):
                int8_write(vw.contiguous(), s._pair_views(self.layer, pid, "v"), w.blocks, w.offsets)
                continue  # encoded and written in one native call per side
            if pair.joint:  # one encode for K and V together
                both = pair.k.encode_tokens(torch.cat((kw, vw)))
                n = kw.shape[0]
                put_tokens(s._pair_views(self.layer, pid, "k"), {f: t[:n] for f, t in both.items()}, w.blocks, w.offsets)
                put_tokens(s._pair_views(self.layer, pid, "v"), {f: t[n:] for f, t in both.items()}, w.blocks, w.offsets)
                continue
            if not pair.k.grouped:
                put_tokens(s._pair_views(self.layer, pid, "k"), pair.k.encode_tokens(kw), w.blocks, w.offsets)
            put_tokens(s._pair_views(self.layer, pid, "v"), pair.v.encode_tokens(vw), w.blocks, w.offsets)
        if plan.shadow_rows is not None:
            shadow = s.shadows[self.layer]
            shadow[0].index_put_((plan.shadow_slots, plan.shadow_offsets), k[plan.shadow_rows].to(s.dtype))
            shadow[1].index_put_((plan.shadow_slots, plan.shadow_offsets), v[plan.shadow_rows].to(s.dtype))
        for pid, f in plan.finalize:
            pair = s.layer_pair(self.layer, pid)
            if not pair.k.grouped:  # a per-layer pool: this layer's keys were written per token
                continue
            if f.first_rows is not None:
                rows = f.first_rows[:, None] + torch.arange(s.block_size, device=k.device)
                x = k[rows]                                             # [m, bs, kvh, d]
            else:
                assert f.slots is not None
                x = s.shadows[self.layer][0].index_select(0, f.slots)
            put_blocks(s._pair_views(self.layer, pid, "k"), pair.k.encode_blocks(x), f.blocks)

    def int8_write_args(self) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None:
        """What :meth:`write` would hand ``kvserve.native.fused.int8_write`` this step, when that is
        all it would do: ``(blocks, offsets, [k scale, k codes, v scale, v codes])`` for a CPU pool
        whose step writes every row through one joint int8 pair (no shadows, nothing to finalize),
        else None. A native caller (``kvserve.model.decode_stack``) then writes without calling back."""
        s, plan = self.storage, self.storage.plan
        if plan is None or s.device.type != "cpu" or plan.shadow_rows is not None or plan.finalize \
                or len(plan.writes) != 1:
            return None
        (pid, w), = plan.writes.items()
        pair = s.layer_pair(self.layer, pid)
        if not (w.all_rows and pair.joint and pair.k.name == "int8"):
            return None
        k, v = s._pair_views(self.layer, pid, "k"), s._pair_views(self.layer, pid, "v")
        return w.blocks, w.offsets, [k["scale"], k["q"], v["scale"], v["q"]]

    def pair(self, pid: int) -> CodecPair:
        """The codec pair this layer uses for blocks written by pair ``pid`` (a per-layer pool's
        layers differ for pid 0; read ``storage.block_pair`` for a block's pid)."""
        return self.storage.layer_pair(self.layer, pid)

    # -- reading -----------------------------------------------------------------------------
    def decode_blocks(self, ids: torch.Tensor) -> torch.Tensor:
        """Decode blocks ``ids [M]`` from the pool (no shadows): ``[2, M, bs, kvh, d]`` (K, V)."""
        s = self.storage
        m = ids.numel()
        tail = (s.block_size, s.kv_heads, s.head_dim)
        single = next(iter(s.pairs_used)) if len(s.pairs_used) == 1 else None
        plane = s.planes[self.layer] if s.planes is not None else None
        if plane is not None:
            raw = plane.index_select(1, ids)                             # [2, M, side bytes]: one gather
            if single is not None and s.layer_pair(self.layer, single).joint:
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
        pair = self.storage.layer_pair(self.layer, pid)
        codec, placed = (pair.k, pair.k_fields) if side == "k" else (pair.v, pair.v_fields)
        return codec.decode(field_views(raw, placed), self.storage.dtype)

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
