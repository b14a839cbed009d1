"""Fused small ops of the decoder (RMSNorm, residual add + RMSNorm, rope, rope + KV write, SiLU·mul),
native or torch.

Each op has a torch reference here (``*_reference``: exactly the ops the model ran before) and a
C++ kernel (``csrc/fused_ops.cpp``, built on first use by :func:`kvserve.native.load_extension`)
that rounds to the model dtype at the same points, so both agree to the last bit except where a
float sum (the RMS) adds in another order. The kernel runs when it loaded (not with
``KVSERVE_NATIVE=0``, without a compiler or after a failed build), the tensors are on the CPU and
laid out as it expects, and no gradient is wanted; otherwise the reference runs. The choice is
recorded once as ``KernelChoice("fused_ops", "all", "native" | "torch")``.

Invariant: every function returns the same shape and dtype either way, and never mutates its inputs.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from kvserve.native import extensions, unavailable_reason
from kvserve.native.choices import KernelChoice, record

_ROUND_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def _ext() -> ModuleType | None:
    mod = extensions.load(extensions.FUSED)
    why = unavailable_reason(extensions.FUSED.name)
    record(KernelChoice("fused_ops", "all", "native" if mod is not None else "torch", {},
                        "default" if mod is not None else f"fallback: {why}"))
    return mod


def _native(*ts: torch.Tensor) -> ModuleType | None:
    """The extension, if it may run on these tensors."""
    if any(t.device.type != "cpu" or t.dtype not in _ROUND_CODE for t in ts):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return None
    return _ext()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_norm(x.float()).to(x.dtype)`` over the last dim of ``x [..., n]``."""
    ext = _native(x, weight)
    if ext is None or x.dim() != 2 or x.stride(-1) != 1 or weight.dtype != x.dtype or not weight.is_contiguous():
        return rms_norm_reference(x, weight, eps)
    return ext.rms_norm(x, weight, eps)  # type: ignore[no-any-return]


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = residual + x
    return rms_norm_reference(h, weight, eps), h


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x) * weight, residual + x)`` for ``[rows, n]`` inputs."""
    ext = _native(x, residual, weight)
    if (ext is None or x.dim() != 2 or x.stride(-1) != 1 or not residual.is_contiguous()
            or residual.shape != x.shape or residual.dtype != x.dtype or weight.dtype != x.dtype):
        return add_rms_norm_reference(x, residual, weight, eps)
    out, h = ext.add_rms_norm(x, residual, weight, eps)
    return out, h


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from kvserve.model.rope import apply_rotary

    return apply_rotary(x, cos, sin)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, d]`` by ``cos/sin [T, d]`` (:func:`kvserve.model.rope.apply_rotary`)."""
    ext = _native(x, cos, sin)
    if (ext is None or x.dim() != 3 or x.stride(-1) != 1 or not cos.is_contiguous() or not sin.is_contiguous()
            or cos.dtype != x.dtype or sin.dtype != x.dtype):
        return rotary_reference(x, cos, sin)
    return ext.rotary(x, cos, sin)  # type: ignore[no-any-return]


def rope_write_reference(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                         cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """What the attention layer did op by op: rotate q and k, write k and v into the float pool's
    layer tensor ``cache [2, blocks, block_size, kv_heads, d]`` at ``slots``; returns q."""
    qk, v = qkv.split([heads + kv_heads, kv_heads], dim=1)
    qk = rotary(qk, cos, sin)
    q, k = qk.split([heads, kv_heads], dim=1)
    flat = cache.view(2, cache.shape[1] * cache.shape[2], *cache.shape[3:])
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)
    return q


def rope_write(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
               cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """An attention layer's prologue in one call: ``qkv [T, heads + 2 * kv_heads, d]`` (the
    projection's output) -> the rotated queries ``[T, heads, d]``, with the rotated keys and the
    values written into ``cache`` (a float pool's layer tensor, qkv's dtype) at ``slots``. Bit-equal
    to :func:`rope_write_reference` (the same roundings)."""
    ext = _native(qkv, cos, sin, cache)
    if (ext is None or qkv.dim() != 3 or qkv.stride(-1) != 1 or qkv.stride(1) != qkv.shape[2]
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype
            or cache.dtype != qkv.dtype or not cache.is_contiguous() or slots.dtype != torch.int64):
        return rope_write_reference(qkv, heads, kv_heads, cos, sin, cache, slots)
    return ext.rope_write(qkv, heads, kv_heads, cos, sin, cache, slots.contiguous())  # type: ignore[no-any-return]


def silu_mul_reference(gu: torch.Tensor, width: int, round_dtype: torch.dtype | None = None) -> torch.Tensor:
    r = round_dtype or gu.dtype
    g = gu.to(r)
    return (F.silu(g[:, :width]) * g[:, width:]).to(gu.dtype)


SILU_NATIVE_ROWS = 2
"""Rows up to which the kernel's 8-lane loop runs ``silu_mul``; more go to torch's own vectorised
ops (``benchmarks/cpu_ops.py`` on an AMX Xeon, width 4,864, bf16: 6-7 against 12-15 µs at one row,
19-23 either way at 4, 1.4-1.6 against 1.0-1.1 ms at 512)."""
SILU_WIDE_ROWS = 1 << 30
"""The same for bf16 on a build with the 16-lane loop (AVX-512 + AVX512-BF16): every row count.
Session 21, AMX Xeon, width 4,864, bf16 in and out (``benchmarks/cpu_ops.py``): 0.59-0.70x torch's
time at 16-512 rows (885 against 1,316 µs at 512); whole prompts 1.39x faster at 512 tokens
(``benchmarks/silu_ab.py``)."""


def silu_native_rows(dtype: torch.dtype, round_dtype: torch.dtype | None = None) -> int:
    """Up to how many rows :func:`silu_mul` runs the kernel on ``gu`` of ``dtype`` rounded to
    ``round_dtype`` (default ``dtype``): :data:`SILU_WIDE_ROWS` where the 16-lane loop takes the
    call (bf16 throughout), else :data:`SILU_NATIVE_ROWS`."""
    return _native_rows(_ext(), dtype, round_dtype or dtype)


def _native_rows(ext: ModuleType | None, dtype: torch.dtype, round_dtype: torch.dtype) -> int:
    wide = ext is not None and dtype == round_dtype == torch.bfloat16 and _silu16(ext)
    return SILU_WIDE_ROWS if wide else SILU_NATIVE_ROWS


@functools.cache
def _silu16(ext: ModuleType) -> bool:
    """Whether the build has the 16-lane loop (asked once per module, not per call)."""
    return bool(ext.silu16())


def silu_mul(gu: torch.Tensor, width: int, round_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``silu(gate) * up`` over ``gu [rows, 2*width]`` (gate columns first), computed in
    ``round_dtype`` (default: ``gu``'s; FBGEMM's fp32 output is rounded to the model dtype first,
    as the unfused shard did) and returned in ``gu``'s dtype. The kernel up to
    :func:`silu_native_rows` rows, torch's ops for more."""
    r = round_dtype or gu.dtype
    ext = _native(gu)
    if (ext is None or gu.dim() != 2 or gu.stride(-1) != 1 or r not in _ROUND_CODE
            or gu.shape[0] > _native_rows(ext, gu.dtype, r) or (gu.dtype != r and gu.dtype != torch.float32)):
        return silu_mul_reference(gu, width, round_dtype)
    return ext.silu_mul(gu, width, _ROUND_CODE[r])  # type: ignore[no-any-return]


def int8_write(x: torch.Tensor, views: dict[str, torch.Tensor], blocks: torch.Tensor, offsets: torch.Tensor) -> bool:
    """Encode ``x [T, kv_heads, head_dim]`` as :class:`~kvserve.kv.quant.Int8Codec` does and write
    it to slots ``(blocks, offsets)`` of its field ``views`` (``scale``, ``q``), the codes bit for
    bit torch's. False (nothing written) where the kernel cannot run: the caller encodes in torch."""
    ext = _native(x)
    scale, q = views.get("scale"), views.get("q")
    if (ext is None or scale is None or q is None or not x.is_contiguous() or x.dim() != 3
            or blocks.dtype != torch.int64 or offsets.dtype != torch.int64):
        return False
    ext.int8_write(x, scale, q, blocks.contiguous(), offsets.contiguous())
    return True


def rope_int8_write(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                    k_views: dict[str, torch.Tensor], v_views: dict[str, torch.Tensor], blocks: torch.Tensor,
                    offsets: torch.Tensor) -> torch.Tensor | None:
    """:func:`rope_write` for an int8 pool: the rotated queries ``[T, heads, d]``, with the rotated
    keys and the values encoded into the int8 codec's K / V field ``views`` (``scale``, ``q``) at
    slots ``(blocks, offsets)``; bit-equal to :func:`rotary` on q and k, then :func:`int8_write` of
    k and of v. None (nothing written) where the kernel cannot run."""
    ext = _native(qkv, cos, sin)
    if (ext is None or qkv.dim() != 3 or qkv.stride(-1) != 1 or qkv.stride(1) != qkv.shape[2]
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype
            or blocks.dtype != torch.int64 or offsets.dtype != torch.int64
            or not {"scale", "q"} <= k_views.keys() or not {"scale", "q"} <= v_views.keys()):
        return None
    return ext.rope_int8_write(qkv, heads, kv_heads, cos, sin, k_views["scale"], k_views["q"],  # type: ignore[no-any-return]
                               v_views["scale"], v_views["q"], blocks.contiguous(), offsets.contiguous())
