"""The ``native`` attention backend: a C++ kernel that reads K/V in their blocks (no gather copy).

``kvserve/native/csrc/paged_attention.cpp`` walks each sequence's block table and keeps a
flash-style online softmax over blocks; every query head of one KV head shares each K/V read
(GQA-grouped); tasks ``(sequence, kv head, query tile)`` run on torch's thread pool. It covers
decodes and prefill chunks (causal mask over the existing context), sliding windows, the float
pools (bf16/fp16/fp32) and the codecs int8, fp8 and int4 (dequantized block by block into an
L1-sized fp32 scratch from the codec's own fields), including blocks read from the
full-precision shadows of :mod:`kvserve.kv.storage`.

What stays on the torch path (:mod:`kvserve.model.attention`), sequence by sequence: sinks,
dropped blocks inside the window and block scores (:mod:`kvserve.model.attention_kept`); and the
whole layer when its KV is a codec pool holding blocks of more than one codec pair (a per-request
``kv_cache_dtype`` override), or when the extension is unavailable (:func:`native_module` is None:
``KVSERVE_NATIVE=0``, no compiler, a failed build).

Invariant: the kernel's output equals softmax(q kᵀ · scale) v over each query's visible keys, up
to float rounding (fp32 accumulation; tests/native/test_paged_native.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from kvserve import native
from kvserve.kv.layer_kv import CodecLayerKV, LayerKV, PlainLayerKV, as_layer_kv
from kvserve.kv.quant import Fp8Codec, IdentityCodec, Int4ChannelCodec, Int4TokenCodec, Int8Codec
from kvserve.model import attention
from kvserve.model.attention import AttentionMetadata, StepPlan
from kvserve.native import extensions, fused

EXTENSION = extensions.PAGED.name
FLOAT_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
"""The kernel's code for a float pool's (and a query's) dtype."""
# Query tokens per task in a prefill chunk (rows = tokens x the GQA group): enough rows to reuse
# each decoded block, few enough that the scratch stays in L1/L2 and causal tiles balance.
Q_TILE = 8
# Which kernel path: 0 the fastest that covers the case: on an int8 pool the int8-dot one
# (AVX512-VNNI builds: bf16 queries, head_dim a multiple of 32 up to 128, no shadows; integer dot
# products on the codes, paged_int8.h), else the bf16-dot one (AVX512-BF16 builds: bf16 queries on
# the bf16, int8 or fp8 pool, head_dim a multiple of 32; vdpbf16ps for the scores and the V sums),
# else the tiled one (AVX2 + FMA, head_dim a multiple of 8; register-blocked scores and V sums
# over 16-key tiles), else the scalar one; 1 always the scalar one; 2 the tiled one (never a dot
# path); 3 as 0 but never int8-dot; 4 as 3 with the bf16-dot path's products on vdpbf16ps even
# where AMX tiles are usable (where they are, IMPL 0 and 3 take its scores and V sums on the
# tiles: amx_attention.h). Tests compare each against the reference.
IMPL = 0


def native_module() -> ModuleType | None:
    """The compiled kernel, built on first use; None (with :func:`unavailable_reason`) when not."""
    return extensions.load(extensions.PAGED)


def unavailable_reason() -> str | None:
    return native.unavailable_reason(EXTENSION)


def kernel_path(dtype: torch.dtype, head_dim: int, codec: str = "float") -> str:
    """Which of the kernel's paths a model of this dtype and head_dim runs on a pool of ``codec``
    (``"float"``: the bf16/fp16/fp32 pools and fp8; ``"int8"``; int4 pools: the tiled path where it
    exists): ``int8_dot`` (int8 pools without shadows), ``bf16_dot_amx`` (its products on AMX
    tiles), ``bf16_dot``, ``tiled`` or ``scalar`` (``IMPL``, the build's instruction sets and the
    OS's AMX permission decide, as in ``paged_attention.cpp``)."""
    mod = native_module()

    def has(name: str) -> bool:
        return bool(getattr(mod, name, lambda: False)())

    dot = IMPL in (0, 3, 4) and dtype == torch.bfloat16 and head_dim % 32 == 0
    if dot and codec == "int8" and IMPL == 0 and head_dim <= 128 and has("int8dot_available"):
        return "int8_dot"
    if dot and has("bf16dot_available"):
        return "bf16_dot_amx" if IMPL != 4 and has("amx_available") else "bf16_dot"
    return "tiled" if IMPL != 1 and head_dim % 8 == 0 and has("tiled_available") else "scalar"


@dataclass
class NativePlan:
    """One step's kernel inputs, shared by every layer: the sequences the kernel attends (their
    query starts/lengths, context lengths, windows, padded block tables) and the ones the torch
    path attends (``kept``). ``torch_plan`` is built only if a layer falls back entirely."""

    seqs: list[int]
    q_start: torch.Tensor
    q_len: torch.Tensor
    seq_len: torch.Tensor
    window: torch.Tensor
    tables: torch.Tensor
    kept: list[int]
    torch_plan: StepPlan | None = field(default=None)


def plan_native(meta: AttentionMetadata) -> NativePlan:
    """The step's kernel inputs (built once per step, on the step's path: four index vectors in
    one tensor, and a lone sequence's table used as it is, without a padded copy)."""
    n = meta.num_seqs
    plain = meta.seq_sinks is None and meta.dropped is None and meta.score_queries is None
    kept = [] if plain else [i for i in range(n) if meta.kept_path(i)]
    seqs = list(range(n)) if not kept else [i for i in range(n) if i not in set(kept)]
    bs = meta.block_size
    blocks = [-(-meta.seq_lens[i] // bs) for i in seqs]
    if not seqs:
        tables = torch.zeros(0, 1, dtype=torch.int64)
    elif len(seqs) == 1:
        tables = meta.block_tables[seqs[0]][: blocks[0]].cpu().reshape(1, -1).contiguous()
    else:  # rows padded with 0 to the longest (never read past a row's own length)
        tables = pad_sequence([meta.block_tables[i][:nb].cpu() for i, nb in zip(seqs, blocks)], batch_first=True)
    qsl = meta.query_start_loc
    index = torch.tensor([[qsl[i] for i in seqs], [qsl[i + 1] - qsl[i] for i in seqs],
                          [meta.seq_lens[i] for i in seqs], [meta.window_of(i) or 0 for i in seqs]],
                         dtype=torch.int64).reshape(4, len(seqs))
    return NativePlan(seqs, index[0], index[1], index[2], index[3], tables, kept)


_EMPTY_B = torch.zeros(0, dtype=torch.bool)
_EMPTY_L = torch.zeros(0, dtype=torch.int64)


@dataclass(frozen=True)
class KVSource:
    """Where a layer's K and V bytes are, in the kernel's terms (see the .cpp header)."""

    k_base: torch.Tensor
    k_params: list[int]
    v_base: torch.Tensor
    v_params: list[int]
    shadow: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _plain_source(t: torch.Tensor) -> KVSource | None:
    if t.dtype not in FLOAT_KIND or not t.is_contiguous() or t.device.type != "cpu":
        return None
    stride = t[0, 0].numel() * t.element_size()
    params = [FLOAT_KIND[t.dtype], stride, 0, 0, 0, 1]
    return KVSource(t[0], params, t[1], list(params), (t.new_zeros(0), _EMPTY_B, _EMPTY_L, _EMPTY_L))


def _side_params(codec: Any, placed: Any, region: torch.Tensor) -> list[int] | None:
    offs = {f.name: off for f, off in placed}
    stride = region.stride(0)
    if isinstance(codec, IdentityCodec) and codec.dtype in FLOAT_KIND:
        return [FLOAT_KIND[codec.dtype], stride, 0, 0, offs["data"], 1]
    if isinstance(codec, (Int8Codec, Fp8Codec)):
        return [3 if isinstance(codec, Int8Codec) else 4, stride, offs["scale"], 0, offs["q"], 1]
    if isinstance(codec, Int4TokenCodec):
        return [5, stride, offs["scale"], offs["zero"], offs["q"], 1]
    if isinstance(codec, Int4ChannelCodec):
        return [6, stride, offs["scale"], offs["zero"], offs["q"], codec.group_size]
    return None


def _codec_source(cache: CodecLayerKV) -> KVSource | None:
    s = cache.storage
    if len(s.pairs_used) != 1 or s.device.type != "cpu":
        return None
    pid = next(iter(s.pairs_used))
    if not s.shadow_of:
        hit = _CODEC_SOURCES.get(cache)
        if hit is not None and hit[0] == pid:
            return hit[1]
    src = _codec_source_of(cache, pid)
    if not s.shadow_of:
        _CODEC_SOURCES[cache] = (pid, src)
    return src


def _codec_source_of(cache: CodecLayerKV, pid: int) -> KVSource | None:
    s = cache.storage
    pair = cache.pair(pid)  # this layer's pair (a per-layer map's differ)
    kr, vr = s.k_regions[cache.layer], s.v_regions[cache.layer]
    if kr.stride(1) != 1 or vr.stride(1) != 1:
        return None
    kp, vp = _side_params(pair.k, pair.k_fields, kr), _side_params(pair.v, pair.v_fields, vr)
    if kp is None or vp is None:
        return None
    if s.shadow_of:
        # kvserve.kv.storage mirrors: which blocks have a shadow, its slot, how many rows it serves.
        shadow = (s.shadows[cache.layer], s._has_shadow, s._shadow_slot, s._shadow_rows)
    else:
        shadow = (torch.zeros(0, dtype=s.dtype), _EMPTY_B, _EMPTY_L, _EMPTY_L)
    return KVSource(kr, kp, vr, vp, shadow)


_PLAIN_SOURCES: weakref.WeakKeyDictionary[PlainLayerKV, KVSource | None] = weakref.WeakKeyDictionary()
"""A float pool's layer views never change: their source is built once."""
_CODEC_SOURCES: weakref.WeakKeyDictionary[CodecLayerKV, tuple[int, KVSource | None]] = weakref.WeakKeyDictionary()
"""A codec pool's source depends on the one pair in use (its regions never change): kept per layer
with that pair's id while no block has a shadow (the shadow tensors' state is per step)."""


def kv_source(cache: LayerKV) -> KVSource | None:
    """The kernel's view of ``cache``, or None when the kernel cannot read it (torch path)."""
    if isinstance(cache, PlainLayerKV):
        if cache not in _PLAIN_SOURCES:
            _PLAIN_SOURCES[cache] = _plain_source(cache.tensor)
        return _PLAIN_SOURCES[cache]
    if isinstance(cache, CodecLayerKV):
        return _codec_source(cache)
    return None


def run_kernel(mod: ModuleType, q: torch.Tensor, out: torch.Tensor, plan: NativePlan, src: KVSource,
               block_size: int, kv_heads: int, scale: float) -> None:
    """Fill ``out``'s rows of ``plan.seqs`` (q, out contiguous ``[T, H, D]``)."""
    mod.paged_attention(q, out, plan.q_start, plan.q_len, plan.seq_len, plan.window, plan.tables, scale,
                        block_size, kv_heads, src.k_base, src.k_params, src.v_base, src.v_params, *src.shadow,
                        Q_TILE, IMPL)


class NativePagedBackend:
    """The C++ kernel for every sequence it covers; the torch path for the rest (module doc)."""

    name = "native"

    def __init__(self, module: ModuleType | None = None, *, decode: bool = True, prefill: bool = True,
                 short_prefill: bool | None = None, short_chunk: int = 0,
                 long_prefill: bool | None = None, long_chunk: int = 0) -> None:
        """Whether steps of each kind use the kernel (the others are planned and run as the torch
        backend does): ``decode`` (every sequence decodes), ``short_prefill`` (the longest chunk
        has at most ``short_chunk`` new tokens; default: as ``prefill``), ``long_prefill`` (the
        longest chunk has more than ``long_chunk`` new tokens, where ``long_chunk`` > 0; default: as
        ``prefill``), ``prefill`` (the rest)."""
        self._module = module
        self.decode, self.prefill = decode, prefill
        self.short_prefill = prefill if short_prefill is None else short_prefill
        self.short_chunk = short_chunk
        self.long_prefill = prefill if long_prefill is None else long_prefill
        self.long_chunk = long_chunk

    def _uses_kernel(self, meta: AttentionMetadata) -> bool:
        if meta.all_decode:
            return self.decode
        qsl = meta.query_start_loc
        longest = max(qsl[i + 1] - qsl[i] for i in range(meta.num_seqs))
        if longest <= self.short_chunk:
            return self.short_prefill
        return self.long_prefill if 0 < self.long_chunk < longest else self.prefill

    @property
    def module(self) -> ModuleType | None:
        if self._module is None:
            self._module = native_module()
        return self._module

    def plan(self, meta: AttentionMetadata, kv_shape: tuple[int, ...], device: torch.device) -> Any:
        if not self._uses_kernel(meta):
            return attention.plan_step(meta, kv_shape, device)
        return plan_native(meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKV,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if isinstance(meta.plan, StepPlan):  # a step this backend leaves to the torch path
            return attention.paged_attention(q, k, v, kv_cache, meta, scale)
        cache = as_layer_kv(kv_cache)
        cache.write(k, v, meta.slot_mapping)
        return self._attend(q, cache, meta, scale)

    def forward_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: LayerKV,
                    meta: AttentionMetadata, scale: float, heads: int) -> torch.Tensor | None:
        """The layer from its projection's output ``qkv [T, heads + 2 * kv_heads, d]``: rope and the
        K/V write in one native call (:func:`kvserve.native.fused.rope_write`; an int8 pool whose
        step writes every row through one joint pair: :func:`~kvserve.native.fused.rope_int8_write`),
        then :meth:`forward`'s read. Only for a float pool in the model's dtype or such an int8 pool,
        on a step the kernel plans; None otherwise (the caller runs rope and :meth:`forward` itself)."""
        if not isinstance(meta.plan, NativePlan) or self.module is None:
            return None
        if isinstance(kv_cache, CodecLayerKV):
            args = kv_cache.int8_write_args()
            if args is None:
                return None
            blocks, offsets, (ks, kq, vs, vq) = args
            q = fused.rope_int8_write(qkv, heads, kv_cache.shape[3], cos, sin, {"scale": ks, "q": kq},
                                      {"scale": vs, "q": vq}, blocks, offsets)
            return None if q is None else self._attend(q, kv_cache, meta, scale)
        if not isinstance(kv_cache, PlainLayerKV):
            return None
        pool = kv_cache.tensor
        if pool.dtype != qkv.dtype or pool.device.type != "cpu":
            return None
        q = fused.rope_write(qkv, heads, pool.shape[3], cos, sin, pool, meta.slot_mapping)
        return self._attend(q, kv_cache, meta, scale)

    def _attend(self, q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """The read half: K/V of this step already written."""
        plan: NativePlan = meta.plan if isinstance(meta.plan, NativePlan) else plan_native(meta)
        mod = self.module
        src = kv_source(cache) if mod is not None and q.device.type == "cpu" else None
        out = torch.empty_like(q)
        if src is None:  # the whole layer on the torch path
            if plan.torch_plan is None:
                plan.torch_plan = attention.plan_step(meta, cache.shape, q.device)
            return attention.attend_written(q, cache, meta, plan.torch_plan, scale, out)
        q = q.contiguous()
        if plan.seqs:
            run_kernel(mod, q, out, plan, src, cache.shape[2], cache.shape[3], scale)
        if plan.kept:
            attention.attend_written(q, cache, meta, StepPlan(None, plan.kept), scale, out)
        return out
