"""The codec pairs a KV pool can hold, and where each codec's fields sit in a block.

A pool's blocks have one K region and one V region of fixed byte sizes, set by the pool's own
codec pair (id 0). Another pair (a per-request ``kv_cache_dtype``) may write blocks of the same
pool when its fields fit those regions; it gets the next id. Torch appears only through the
codec objects' field dtypes: no tensor is allocated here, so the engine can check a request's
codec without holding the KV (the runner may be in another process).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.config import CacheConfig, ModelConfig
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

    Invariant: every pair's K and V fields fit the pool pair's region sizes."""

    def __init__(self, pool: KVCodecSpec, *, block_size: int, kv_heads: int, head_dim: int, group_size: int,
                 sink_tokens: int, model_dtype: str) -> None:
        self.block_size, self.kv_heads, self.head_dim = block_size, kv_heads, head_dim
        self.group_size, self.sink_tokens, self.model_dtype = group_size, sink_tokens, model_dtype
        self.pairs: list[CodecPair] = []
        self._ids: dict[str, int] = {}
        self.pool = self.pairs[self._add(pool)]
        self.region_bytes = self.pair_region_bytes(self.pool)

    @classmethod
    def for_model(cls, model: ModelConfig, kv_dtype: str, cache: CacheConfig, block_size: int) -> CodecPairs:
        return cls(parse_kv_codecs(kv_dtype, model.dtype), block_size=block_size,
                   kv_heads=model.num_key_value_heads, head_dim=model.head_dim,
                   group_size=int4_group_size(block_size, cache.kv_quant_group_size),
                   sink_tokens=cache.kv_quant_sink_tokens, model_dtype=model.dtype)

    def pair_region_bytes(self, pair: CodecPair) -> tuple[int, int]:
        args = (self.block_size, self.kv_heads, self.head_dim)
        return pair.k.block_bytes(*args), pair.v.block_bytes(*args)

    def _add(self, spec: KVCodecSpec) -> int:
        if spec.name in self._ids:
            return self._ids[spec.name]
        k = make_codec(spec.k, "k", self.group_size)
        v = make_codec(spec.v, "v", self.group_size)
        args = (self.block_size, self.kv_heads, self.head_dim)
        kf, vf = place_fields(k.fields(*args)), place_fields(v.fields(*args))
        pair = CodecPair(spec, k, v, kf, vf, sinks=self.sink_tokens > 0 and "int4" in (spec.k, spec.v),
                         joint=spec.k == spec.v and not k.grouped and kf == vf)
        self.pairs.append(pair)
        self._ids[spec.name] = len(self.pairs) - 1
        return len(self.pairs) - 1

    def pair_for(self, spec: str | KVCodecSpec | None) -> int:
        """The id of the pair for a request's ``kv_cache_dtype`` (``None`` = the pool's), checking
        that it fits this pool. Raises ValueError naming what does fit."""
        if spec is None:
            return 0
        parsed = spec if isinstance(spec, KVCodecSpec) else parse_kv_codecs(spec, self.model_dtype)
        if parsed.name in self._ids:
            return self._ids[parsed.name]
        k = make_codec(parsed.k, "k", self.group_size)
        v = make_codec(parsed.v, "v", self.group_size)
        args = (self.block_size, self.kv_heads, self.head_dim)
        kb, vb = self.region_bytes
        if k.block_bytes(*args) > kb or v.block_bytes(*args) > vb:
            raise ValueError(f"kv_cache_dtype {parsed.name!r} needs more bytes per block than this engine's "
                             f"{self.pool.spec.name!r} pool holds; use a codec no wider than the pool's")
        needs_window = k.grouped or (self.sink_tokens > 0 and "int4" in (parsed.k, parsed.v))
        if needs_window and not (self.pool.k.grouped or self.pool.sinks):
            raise ValueError(f"kv_cache_dtype {parsed.name!r} keeps unfinished int4 key groups or sink "
                             f"tokens in full precision, which needs an engine whose kv_cache_dtype uses int4")
        return self._add(parsed)

    def __getitem__(self, pid: int) -> CodecPair:
        return self.pairs[pid]

    def id_of(self, name: str) -> int:
        return self._ids[name]
