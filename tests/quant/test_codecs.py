"""KV codecs: registry and spec parsing, byte sizes equal to the layout's, round-trip error bounds."""

from __future__ import annotations

import pytest
import torch

from kvserve.kv import layout
from kvserve.kv.quant import (
    CODEC_NAMES,
    Int4ChannelCodec,
    Int4TokenCodec,
    KVCodecSpec,
    make_codec,
    pack_int4,
    parse_kv_codecs,
    round_trip,
    unpack_int4,
)


def kv_like(m: int = 4, bs: int = 16, kvh: int = 2, d: int = 32, seed: int = 0) -> torch.Tensor:
    """Blocks of K-like data: unit noise plus two outlier channels (as real keys have)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, bs, kvh, d, generator=g)
    x[..., 3] = x[..., 3] * 8 + 15
    x[..., 17] -= 10
    return x


def test_names_aliases_and_mixed_specs() -> None:
    assert parse_kv_codecs("int8") == KVCodecSpec("int8", "int8")
    assert parse_kv_codecs("bfloat16") == KVCodecSpec("bfloat16", "bfloat16")
    assert parse_kv_codecs("auto", "float32") == KVCodecSpec("float32", "float32")
    assert parse_kv_codecs("E4M3") == KVCodecSpec("fp8", "fp8")
    spec = parse_kv_codecs("k:int8, v:int4")
    assert (spec.k, spec.v, spec.name) == ("int8", "int4", "k:int8,v:int4")
    assert parse_kv_codecs(spec.name) == spec
    assert parse_kv_codecs("v:int8,k:int8").name == "int8"
    assert not parse_kv_codecs("bf16").lossy and parse_kv_codecs("k:bf16,v:int8").lossy


@pytest.mark.parametrize("bad", ["int3", "k:int8", "k:int8,k:int4", "x:int8,v:int8", "k:int8,v:nf4", ""])
def test_unknown_or_malformed_codec_names_the_valid_ones(bad: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_kv_codecs(bad)
    msg = str(e.value)
    assert "int8" in msg and ("valid" in msg or "k:" in msg)


def test_unknown_codec_message_lists_every_codec() -> None:
    with pytest.raises(ValueError) as e:
        parse_kv_codecs("int2")
    for name in CODEC_NAMES:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="valid: auto"):
        layout.resolve_kv_dtype("int2")


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("side", ["k", "v"])
@pytest.mark.parametrize("bs, kvh, d", [(16, 2, 32), (32, 8, 128), (4, 1, 8), (16, 2, 64), (64, 3, 80)])
def test_block_bytes_match_the_layout(name: str, side: str, bs: int, kvh: int, d: int) -> None:
    group = layout.int4_group_size(bs)
    codec = make_codec(name, side, group)
    fields = codec.fields(bs, kvh, d)
    assert codec.block_bytes(bs, kvh, d) == layout.side_block_bytes(layout.resolve_kv_dtype(name), side, bs, kvh, d)
    assert sum(f.nbytes for f in fields) <= codec.block_bytes(bs, kvh, d) < sum(f.nbytes for f in fields) + 4


def test_layout_per_token_formula_equals_block_bytes() -> None:
    # Llama-3-8B shape, block 32 (int4 groups of 32): the planner's per-token figure is exact.
    for name in ("bfloat16", "fp8", "int8", "int4", "k:int8,v:int4"):
        per_block = layout.kv_block_bytes(32, 8, 128, name, 32)
        assert per_block == 32 * layout.kv_bytes_per_token(32, 8, 128, name)
    # int8 ≈ 2×, int4 ≈ 3.5× the bf16 token count at head_dim 128.
    bf16 = layout.kv_bytes_per_token(32, 8, 128, "bf16")
    assert 1.9 < bf16 / layout.kv_bytes_per_token(32, 8, 128, "int8") < 2.0
    assert 3.4 < bf16 / layout.kv_bytes_per_token(32, 8, 128, "int4") < 3.5


def test_int4_pack_round_trip() -> None:
    q = torch.randint(0, 16, (5, 3, 8), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 3, 4) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)


def test_identity_codecs_are_exact_in_their_dtype() -> None:
    x = kv_like()
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        y = round_trip(make_codec(name, "k", 16), x)
        assert torch.equal(y, x.to(dtype).float())


def test_int8_error_is_at_most_half_a_step() -> None:
    x = kv_like()
    y = round_trip(make_codec("int8", "k", 16), x)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((y - x).abs() <= step / 2 + 1e-6).all()
    assert (y - x).abs().max() > 0  # it is lossy


def test_fp8_relative_error_bound() -> None:
    x = kv_like()
    y = round_trip(make_codec("fp8", "k", 16), x)
    scale = x.abs().amax(-1, keepdim=True) / 448
    # 3 mantissa bits: relative error ≤ 2^-4 for normals; absolute ≤ half a subnormal step below 2^-6.
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10)
    assert ((y - x).abs() <= bound + 1e-6).all()


def test_int4_value_error_bound_per_token() -> None:
    x = kv_like()
    y = round_trip(make_codec("int4", "v", 16), x)
    rng = x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)
    assert ((y - x).abs() <= rng / 30 * 1.01 + 1e-3).all()


@pytest.mark.parametrize("group", [16, 8, 4])
def test_int4_key_error_bound_per_channel_group(group: int) -> None:
    x = kv_like()
    y = round_trip(Int4ChannelCodec(group), x)
    g = x.view(4, 16 // group, group, 2, 32)
    rng = (g.amax(2, keepdim=True) - g.amin(2, keepdim=True)).expand_as(g).reshape_as(x)
    assert ((y - x).abs() <= rng / 30 * 1.01 + 1e-3).all()


def test_int4_keys_per_channel_beat_per_token_with_outlier_channels() -> None:
    """KIVI's point: keys have outlier channels, so per-channel groups lose far less."""
    x = kv_like()
    per_channel = (round_trip(Int4ChannelCodec(16), x) - x).pow(2).mean()
    per_token = (round_trip(Int4TokenCodec(), x) - x).pow(2).mean()
    assert per_channel * 4 < per_token


def test_sealed_int4_group_ignores_rows_past_num_valid() -> None:
    x = kv_like(m=2)
    garbage = x.clone()
    garbage[:, 5:] = 1e4  # rows a partial block has not written yet
    codec = Int4ChannelCodec(16)
    n = torch.tensor([5, 5])
    sealed = codec.decode(codec.encode_blocks(garbage, n), torch.float32)[:, :5]
    clean = x[:, :5]
    rng = clean.amax(1, keepdim=True) - clean.amin(1, keepdim=True)
    assert ((sealed - clean).abs() <= rng / 30 * 1.01 + 1e-3).all()


def test_encoding_is_deterministic() -> None:
    x = kv_like()
    for name in ("fp8", "int8", "int4"):
        for side in "kv":
            c = make_codec(name, side, 16)
            a, b = c.encode_blocks(x), c.encode_blocks(x.clone())
            assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_odd_head_dim_rejected_for_int4() -> None:
    with pytest.raises(ValueError, match="even head_dim"):
        make_codec("int4", "v", 16).fields(16, 2, 7)


def test_group_must_divide_block() -> None:
    with pytest.raises(ValueError, match="divide"):
        layout.int4_group_size(16, 12)
    assert layout.int4_group_size(16) == 16 and layout.int4_group_size(64) == 32
