"""KV codecs: how one block of keys (or values) is stored, chosen by name from a registry.

A codec turns a block of ``block_size`` tokens ``[bs, kv_heads, head_dim]`` into a few typed
*fields* and back. Storage (:mod:`kvserve.kv.storage`) lays the fields of a block side by side in
the block's bytes, so a codec is fully described by its field list, and its byte cost is the sum
of the fields' sizes — the figure :mod:`kvserve.kv.layout` computes without torch (a test checks
they agree for every codec and shape).

==========  =====================================================================  ===================
codec       fields per block, per KV head                                            bytes / token / head
==========  =====================================================================  ===================
bf16, fp16  data ``[bs, d]`` in that dtype                                           2·d
fp32        data ``[bs, d]`` float32                                                 4·d
fp8         fp32 scale per token; e4m3 data ``[bs, d]``                              d + 4
int8        fp32 scale per token (symmetric, ``amax / 127``); int8 data               d + 4
int4 (K)    fp16 scale + zero per channel per group of G tokens; 4-bit data          d/2 + 4·d/G
int4 (V)    fp16 scale + zero per token (asymmetric); 4-bit data                     d/2 + 4
==========  =====================================================================  ===================

int4 follows KIVI: keys are quantized per *channel* over a group of G tokens (key outliers live in
fixed channels), values per *token*. A key group can only be encoded once all G of its tokens
exist, so int4 keys are a *grouped* codec (``Codec.grouped``): storage keeps the tokens of an
unfinished group in full precision and encodes the group when it fills. G divides the block size,
so a group never straddles two blocks.

Every encode/decode here is a pure function of its inputs (no state), so the same K/V always give
the same bytes: what makes prefix-cache hits and "quantize later" equal "quantize from the start".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.kv.codec_names import CODEC_NAMES, KVCodecSpec, canonical_codec_name, parse_kv_codecs

__all__ = ["CODEC_NAMES", "Codec", "KVCodecSpec", "make_codec", "parse_kv_codecs", "round_trip"]

Fields = dict[str, torch.Tensor]


@dataclass(frozen=True)
class FieldSpec:
    """One stored tensor of a block: ``shape`` is per block (``[bs, kvh, ...]`` or ``[groups, kvh, d]``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Codec:
    """Base class. ``name`` is the registry name; ``lossy`` is False only for the identity codecs;
    ``grouped`` codecs encode whole blocks only (``encode_tokens`` is not available)."""

    name: str = ""
    lossy: bool = True
    grouped: bool = False

    def fields(self, block_size: int, kv_heads: int, head_dim: int) -> tuple[FieldSpec, ...]:
        raise NotImplementedError

    def block_bytes(self, block_size: int, kv_heads: int, head_dim: int) -> int:
        """Bytes one block of this side costs (fields are laid out widest element first, so each
        starts aligned; the total is padded to a multiple of 4)."""
        total = sum(f.nbytes for f in self.fields(block_size, kv_heads, head_dim))
        return -(-total // 4) * 4

    def encode_tokens(self, x: torch.Tensor) -> Fields:
        """``x [T, kvh, d]`` -> per-token fields, each ``[T, ...]`` (the field shape without ``bs``)."""
        raise NotImplementedError(f"{self.name} encodes whole blocks only")

    def encode_blocks(self, x: torch.Tensor, num_valid: torch.Tensor | None = None) -> Fields:
        """``x [m, bs, kvh, d]`` -> fields ``[m, *field.shape]``. ``num_valid [m]`` (grouped codecs):
        only the first ``num_valid`` tokens of each block are real; statistics ignore the rest."""
        m, bs = x.shape[:2]
        return {k: t.view(m, bs, *t.shape[1:]) for k, t in self.encode_tokens(x.reshape(m * bs, *x.shape[2:])).items()}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        """Fields ``[m, *field.shape]`` -> ``[m, bs, kvh, d]`` in ``dtype``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class IdentityCodec(Codec):
    """Full precision in ``dtype`` (bf16, fp16 or fp32): no scales, exact for its dtype."""

    lossy = False

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype

    def fields(self, block_size: int, kv_heads: int, head_dim: int) -> tuple[FieldSpec, ...]:
        return (FieldSpec("data", self.dtype, (block_size, kv_heads, head_dim)),)

    def encode_tokens(self, x: torch.Tensor) -> Fields:
        return {"data": x.to(self.dtype)}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        return fields["data"].to(dtype)


class Int8Codec(Codec):
    """Symmetric int8 with one fp32 scale per token per KV head: ``x ≈ q · amax / 127``.
    Round-trip error per element ≤ ``amax / 254`` (half a step) of its token-head."""

    name = "int8"

    def fields(self, block_size: int, kv_heads: int, head_dim: int) -> tuple[FieldSpec, ...]:
        return (FieldSpec("scale", torch.float32, (block_size, kv_heads)),
                FieldSpec("q", torch.int8, (block_size, kv_heads, head_dim)))

    def encode_tokens(self, x: torch.Tensor) -> Fields:
        xf = x.float()
        scale = (xf.abs().amax(-1) / 127.0).clamp_min(1e-12)        # [T, kvh]
        q = torch.round(xf / scale[..., None]).clamp_(-127, 127).to(torch.int8)
        return {"scale": scale, "q": q}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        # In the target dtype: int8 codes are exact in bf16/fp16, the scale rounds once (2^-9
        # relative in bf16, below the int8 step); two passes instead of four in fp32.
        return fields["q"].to(dtype) * fields["scale"].to(dtype)[..., None]


FP8_MAX = 448.0  # largest finite float8_e4m3fn


class Fp8Codec(Codec):
    """float8 e4m3 with one fp32 scale per token per KV head mapping the token-head's amax to 448.
    Relative error per element ≤ 2⁻⁴ (3 mantissa bits), down to the e4m3 subnormal floor."""

    name = "fp8"

    def fields(self, block_size: int, kv_heads: int, head_dim: int) -> tuple[FieldSpec, ...]:
        return (FieldSpec("scale", torch.float32, (block_size, kv_heads)),
                FieldSpec("q", torch.float8_e4m3fn, (block_size, kv_heads, head_dim)))

    def encode_tokens(self, x: torch.Tensor) -> Fields:
        xf = x.float()
        scale = (xf.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
        q = (xf / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"scale": scale, "q": q}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        q = fp8_to(fields["q"], dtype)
        return (q * (fields["scale"] * _FP8_BIAS_FIX).to(q.dtype)[..., None]).to(dtype)


_FP8_BIAS_FIX = 2.0 ** 120  # e4m3's exponent bias is 7, fp32/bf16's 127


def fp8_to(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 codes as bf16 (for ``dtype`` bf16) or fp32 (any other ``dtype``: fp16 cannot hold the
    tiny values) scaled by 2⁻¹²⁰, by moving bits (torch's own fp8 → float
    cast is scalar code on CPU, ~20x slower). The e4m3 exponent/mantissa bits land in the low
    exponent/mantissa bits of a bf16 (or fp32) number: a normal ``2^(e-7)(1+m/8)`` becomes
    ``2^(e-127)(1+m/8)`` and a subnormal ``m·2⁻⁹`` the subnormal ``m·2⁻¹²⁹``, both exactly
    ``2⁻¹²⁰`` times the e4m3 value; the caller folds ``2¹²⁰`` into the scale."""
    s8 = q.view(torch.int8)  # sign-extending: the sign lands on the top bit, masked below
    if dtype == torch.bfloat16:
        return ((s8.to(torch.int16) << 4) & _MASK16).view(torch.bfloat16)
    return ((s8.to(torch.int32) << 20) & _MASK32).view(torch.float32)


_MASK16 = 0x87F0 - 2**16          # sign bit + the 7 exponent/mantissa bits, as a signed int16
_MASK32 = 0x87F00000 - 2**32


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 ``[..., d]`` (d even) -> ``[..., d/2]``: the first half of the channels in
    the low nibbles, the second half in the high ones (unpacking is then two contiguous halves)."""
    h = q.shape[-1] // 2
    return q[..., :h] | (q[..., h:] << 4)


def unpack_int4(packed: torch.Tensor, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[..., d/2]`` uint8 -> ``[..., d]`` codes in ``dtype``
    (written straight into the two halves of the result: no concatenation pass)."""
    h = packed.shape[-1]
    out = torch.empty((*packed.shape[:-1], 2 * h), dtype=dtype, device=packed.device)
    out[..., :h].copy_(packed & 0xF)
    out[..., h:].copy_(packed >> 4)
    return out


_FP16_MAX = 65504.0


def _affine_params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scale and zero for codes 0..15 over ``[lo, hi]``; the codes are computed against the
    *stored* (rounded) values, so decode matches encode exactly."""
    lo = lo.clamp(-_FP16_MAX, _FP16_MAX)
    hi = hi.clamp(-_FP16_MAX, _FP16_MAX)
    scale = ((hi - lo) / 15.0).clamp_min(1e-6).to(torch.float16)
    return scale, lo.to(torch.float16)


def _affine_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.round((x - zero.float()) / scale.float()).clamp_(0, 15).to(torch.uint8)


class Int4TokenCodec(Codec):
    """Asymmetric int4 per token per KV head (KIVI's value side): fp16 scale and zero (the min),
    codes 0..15 packed two per byte. Error per element ≤ ``(max − min) / 30`` of its token-head."""

    name = "int4"

    def fields(self, block_size: int, kv_heads: int, head_dim: int) -> tuple[FieldSpec, ...]:
        _check_even(head_dim)
        return (FieldSpec("scale", torch.float16, (block_size, kv_heads)),
                FieldSpec("zero", torch.float16, (block_size, kv_heads)),
                FieldSpec("q", torch.uint8, (block_size, kv_heads, head_dim // 2)))

    def encode_tokens(self, x: torch.Tensor) -> Fields:
        xf = x.float()
        scale, zero = _affine_params(xf.amin(-1), xf.amax(-1))       # [T, kvh]
        q = _affine_codes(xf, scale[..., None], zero[..., None])
        return {"scale": scale, "zero": zero, "q": pack_int4(q)}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        q = unpack_int4(fields["q"], dtype)  # a fresh tensor: scaled in place (addcmul's broadcast is slow on CPU)
        return q.mul_(fields["scale"].to(dtype)[..., None]).add_(fields["zero"].to(dtype)[..., None])


class Int4ChannelCodec(Codec):
    """Asymmetric int4 per *channel* over groups of ``group_size`` tokens (KIVI's key side): one
    fp16 scale and zero per (group, KV head, channel). Grouped: a block is encoded once all its
    tokens exist (or, sealed early, over its first ``num_valid`` tokens)."""

    name = "int4"
    grouped = True

    def __init__(self, group_size: int) -> None:
        if group_size <= 0:
            raise ValueError(f"int4 group size must be > 0, got {group_size}")
        self.group_size = group_size

    def _groups(self, block_size: int) -> int:
        if block_size % self.group_size:
            raise ValueError(f"int4 key group size {self.group_size} must divide block_size {block_size}")
        return block_size // self.group_size

    def fields(self, block_size: int, kv_heads: int, head_dim: int) -> tuple[FieldSpec, ...]:
        _check_even(head_dim)
        g = self._groups(block_size)
        return (FieldSpec("scale", torch.float16, (g, kv_heads, head_dim)),
                FieldSpec("zero", torch.float16, (g, kv_heads, head_dim)),
                FieldSpec("q", torch.uint8, (block_size, kv_heads, head_dim // 2)))

    def encode_blocks(self, x: torch.Tensor, num_valid: torch.Tensor | None = None) -> Fields:
        m, bs, kvh, d = x.shape
        g = self._groups(bs)
        xg = x.float().view(m, g, self.group_size, kvh, d)
        lo_src, hi_src = xg, xg
        if num_valid is not None:  # tokens at or past num_valid are garbage: keep them out of min/max
            pos = torch.arange(bs, device=x.device).view(1, g, self.group_size, 1, 1)
            real = pos < num_valid.to(x.device).view(m, 1, 1, 1, 1)
            lo_src = xg.masked_fill(~real, float("inf"))
            hi_src = xg.masked_fill(~real, float("-inf"))
        lo, hi = lo_src.amin(2), hi_src.amax(2)                      # [m, g, kvh, d]
        empty = torch.isinf(lo)                                      # a group with no real token
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
        scale, zero = _affine_params(lo, hi)
        q = _affine_codes(xg, scale[:, :, None], zero[:, :, None]).view(m, bs, kvh, d)
        return {"scale": scale, "zero": zero, "q": pack_int4(q)}

    def decode(self, fields: Fields, dtype: torch.dtype) -> torch.Tensor:
        q = unpack_int4(fields["q"], dtype)                           # [m, bs, kvh, d]
        m, bs, kvh, d = q.shape
        g = fields["scale"].shape[1]
        q = q.view(m, g, bs // g, kvh, d)
        q.mul_(fields["scale"].to(dtype)[:, :, None]).add_(fields["zero"].to(dtype)[:, :, None])
        return q.view(m, bs, kvh, d)


def _check_even(head_dim: int) -> None:
    if head_dim % 2:
        raise ValueError(f"int4 packs two values per byte and needs an even head_dim, got {head_dim}")


# -- the registry -----------------------------------------------------------------------------

_FACTORIES: dict[str, Callable[[str, int], Codec]] = {
    "bfloat16": lambda side, g: IdentityCodec("bfloat16", torch.bfloat16),
    "float16": lambda side, g: IdentityCodec("float16", torch.float16),
    "float32": lambda side, g: IdentityCodec("float32", torch.float32),
    "fp8": lambda side, g: Fp8Codec(),
    "int8": lambda side, g: Int8Codec(),
    "int4": lambda side, g: Int4ChannelCodec(g) if side == "k" else Int4TokenCodec(),
}


def make_codec(name: str, side: str, group_size: int) -> Codec:
    """The codec object for one side (``"k"`` or ``"v"``). ``group_size`` is int4's key group."""
    if side not in ("k", "v"):
        raise ValueError(f"side must be 'k' or 'v', got {side!r}")
    return _FACTORIES[canonical_codec_name(name)](side, group_size)


def round_trip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """Encode then decode whole blocks ``x [m, bs, kvh, d]`` (for tests and the eval's reference)."""
    return codec.decode(codec.encode_blocks(x), x.dtype)
