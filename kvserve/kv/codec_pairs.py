"""The codec pairs a KV pool can hold, and where each codec's fields sit in a block.

A pool's blocks have one K region and one V region of fixed byte sizes per layer, set by the
pool's own codec pair (id 0). Another pair (a per-request ``kv_cache_dtype``) may write blocks of
the same pool when its fields fit those regions in every layer; it gets the next id.

A per-layer pool (a calibrated map, ``layers:…``) has its own pair per layer under id 0: each
layer's regions are sized by that layer's pair, and :meth:`CodecPairs.layer_pair` says which pair
a layer uses for a block of a given id (an override's pair is the same in every layer). Torch appears only through the
codec objects' field dtypes: no tensor is allocated here, so the engine can check a request's
codec without holding the KV (the runner may be in another process).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.config import CacheConfig, ModelConfig
from kvserve.kv.codec_names import map_name, parse_layer_codecs
from kvserve.kv.layout import int4_group_size
from kvserve.kv.quant import Codec, Fields, FieldSpec, KVCodecSpec, make_codec, parse_kv_codecs


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

    @property
    def k_grouped(self) -> bool:
        """Keys are encoded per group of tokens (int4): a block's unfinished group lives in a shadow."""
        return self.k.grouped


@dataclass(frozen=True)
class MapPair:
    """Pair id 0 of a per-layer pool: what block bookkeeping needs of the whole map (any layer
    lossy, any layer with grouped keys or sinks); encode/decode use ``layers[i]``."""

    name: str
    layers: tuple[CodecPair, ...]

    @property
    def lossy(self) -> bool:
        return any(p.lossy for p in self.layers)

    @property
    def k_grouped(self) -> bool:
        return any(p.k.grouped for p in self.layers)

    @property
    def sinks(self) -> bool:
        return any(p.sinks for p in self.layers)


def place_fields(fields: tuple[FieldSpec, ...]) -> tuple[tuple[FieldSpec, int], ...]:
    """Widest element first, so each field starts aligned to its element size."""
    out, off = [], 0
    for f in sorted(fields, key=lambda f: -f.dtype.itemsize):
        out.append((f, off))
        off += f.nbytes
    return tuple(out)


def field_views(region: torch.Tensor, placed: tuple[tuple[FieldSpec, int], ...]) -> Fields:
    """Typed views ``[rows, *field.shape]`` of a ``uint8 [rows, region bytes]`` tensor."""
    rows = region.shape[0]
    return {f.name: region[:, off:off + f.nbytes].view(f.dtype).view(rows, *f.shape) for f, off in placed}


class CodecPairs:
    """Pair ids for one pool: 0 is the pool's own; others are added as requests name them.

    ``pool`` is one pair for every layer, or a tuple with each layer's pair (a tuple whose layers
    agree is that one pair). Invariant: every pair's K and V fields fit the pool's region sizes in
    every layer."""

    def __init__(self, pool: KVCodecSpec | tuple[KVCodecSpec, ...], *, block_size: int, kv_heads: int,
                 head_dim: int, group_size: int, sink_tokens: int, model_dtype: str) -> None:
        self.block_size, self.kv_heads, self.head_dim = block_size, kv_heads, head_dim
        self.group_size, self.sink_tokens, self.model_dtype = group_size, sink_tokens, model_dtype
        self.pairs: list[CodecPair | MapPair] = []
        self._ids: dict[str, int] = {}
        if isinstance(pool, tuple) and len(set(pool)) == 1:
            pool = pool[0]
        self.layer_pools: tuple[CodecPair, ...] | None = None  # per-layer pool: each layer's own pair
        if isinstance(pool, tuple):
            made = {spec: self._make(spec) for spec in set(pool)}
            self.layer_pools = tuple(made[spec] for spec in pool)
            self.pairs.append(MapPair(map_name(pool), self.layer_pools))
            self._ids[self.pairs[0].name] = 0
        else:
            self._add(pool)
        self.pool = self.pairs[0]
        self.layer_regions = [self.pair_region_bytes(p) for p in self.layer_pools] if self.layer_pools else None
        # uniform pools: the one (K, V) region size; per-layer pools: the smallest of each side
        self.region_bytes = (self.pair_region_bytes(self.pool) if self.layer_regions is None else  # type: ignore[arg-type]
                             (min(r[0] for r in self.layer_regions), min(r[1] for r in self.layer_regions)))

    @classmethod
    def for_model(cls, model: ModelConfig, kv_dtype: str, cache: CacheConfig, block_size: int) -> CodecPairs:
        return cls(parse_layer_codecs(kv_dtype, model.dtype, model.num_hidden_layers), block_size=block_size,
                   kv_heads=model.num_key_value_heads, head_dim=model.head_dim,
                   group_size=int4_group_size(block_size, cache.kv_quant_group_size),
                   sink_tokens=cache.kv_quant_sink_tokens, model_dtype=model.dtype)

    @property
    def per_layer(self) -> bool:
        return self.layer_pools is not None

    def regions(self, layer: int) -> tuple[int, int]:
        """(K, V) region bytes of one block in ``layer``."""
        return self.region_bytes if self.layer_regions is None else self.layer_regions[layer]

    def layer_pair(self, layer: int, pid: int) -> CodecPair:
        """The pair that encodes/decodes blocks of id ``pid`` in ``layer``."""
        if pid == 0 and self.layer_pools is not None:
            return self.layer_pools[layer]
        return self.pairs[pid]  # type: ignore[return-value]

    def name_of(self, pid: int) -> str:
        """The canonical name of pair ``pid`` (a map name for a per-layer pool's own)."""
        pair = self.pairs[pid]
        return pair.name if isinstance(pair, MapPair) else pair.spec.name

    def pair_region_bytes(self, pair: CodecPair) -> tuple[int, int]:
        args = (self.block_size, self.kv_heads, self.head_dim)
        return pair.k.block_bytes(*args), pair.v.block_bytes(*args)

    def _make(self, spec: KVCodecSpec) -> CodecPair:
        k = make_codec(spec.k, "k", self.group_size)
        v = make_codec(spec.v, "v", self.group_size)
        args = (self.block_size, self.kv_heads, self.head_dim)
        kf, vf = place_fields(k.fields(*args)), place_fields(v.fields(*args))
        return CodecPair(spec, k, v, kf, vf, sinks=self.sink_tokens > 0 and "int4" in (spec.k, spec.v),
                         joint=spec.k == spec.v and not k.grouped and kf == vf)

    def _add(self, spec: KVCodecSpec) -> int:
        if spec.name in self._ids:
            return self._ids[spec.name]
        self.pairs.append(self._make(spec))
        self._ids[spec.name] = len(self.pairs) - 1
        return len(self.pairs) - 1

    def pair_for(self, spec: str | KVCodecSpec | None) -> int:
        """The id of the pair for a request's ``kv_cache_dtype`` (``None`` = the pool's), checking
        that it fits this pool. Raises ValueError naming what does fit."""
        if spec is None or (isinstance(spec, str) and spec in self._ids):
            return 0 if spec is None else self._ids[spec]
        parsed = spec if isinstance(spec, KVCodecSpec) else parse_kv_codecs(spec, self.model_dtype)
        if parsed.name in self._ids:
            return self._ids[parsed.name]
        k = make_codec(parsed.k, "k", self.group_size)
        v = make_codec(parsed.v, "v", self.group_size)
        args = (self.block_size, self.kv_heads, self.head_dim)
        kb, vb = self.region_bytes
        if k.block_bytes(*args) > kb or v.block_bytes(*args) > vb:
            raise ValueError(f"kv_cache_dtype {parsed.name!r} needs more bytes per block than this engine's "
                             f"{self.name_of(0)!r} pool holds; use a codec no wider than the pool's")
        needs_window = k.grouped or (self.sink_tokens > 0 and "int4" in (parsed.k, parsed.v))
        if needs_window and not (self.pool.k_grouped or self.pool.sinks):
            raise ValueError(f"kv_cache_dtype {parsed.name!r} keeps unfinished int4 key groups or sink "
                             f"tokens in full precision, which needs an engine whose kv_cache_dtype uses int4")
        return self._add(parsed)

    def __getitem__(self, pid: int) -> CodecPair | MapPair:
        return self.pairs[pid]

    def id_of(self, name: str) -> int:
        return self._ids[name]
