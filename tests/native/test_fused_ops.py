"""The fused decoder ops equal their unfused torch references, natively and with KVSERVE_NATIVE=0.

In bf16/fp16, rope and the residual sum round exactly as torch does (bit-equal); the RMS and SiLU
may differ by one unit in the last place (a float sum in another order, another exp). In fp32 no
rounding step hides a different order or a fused multiply-add: a few units in the last place.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import native
from kvserve.native import choices, fused

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL_ULPS = {torch.bfloat16: 1.0, torch.float16: 1.0, torch.float32: 4.0}


@pytest.fixture(scope="module")
def ext():  # type: ignore[no-untyped-def]
    mod = fused._ext()
    if mod is None:
        pytest.skip(f"fused ops not built here: {native.unavailable_reason('kvserve_fused')}")
    return mod


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's epsilon at each element's magnitude."""
    eps = torch.finfo(a.dtype).eps
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(torch.finfo(a.dtype).tiny)
    return float(((a.float() - b.float()).abs() / (scale * eps)).max())


def rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_and_add_rms_norm(ext, dtype: torch.dtype, rows: int) -> None:  # type: ignore[no-untyped-def]
    x, res = rand(rows, 96, dtype=dtype), rand(rows, 96, dtype=dtype, seed=1)
    w = (1 + 0.2 * rand(96, dtype=torch.float32, seed=2)).to(dtype)
    got, ref = fused.rms_norm(x, w, 1e-6), fused.rms_norm_reference(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == ref.shape and ulps(got, ref) <= TOL_ULPS[dtype]
    (n, h), (n_ref, h_ref) = fused.add_rms_norm(x, res, w, 1e-6), fused.add_rms_norm_reference(x, res, w, 1e-6)
    assert torch.equal(h, h_ref) and ulps(n, n_ref) <= TOL_ULPS[dtype]
    assert torch.equal(x, rand(rows, 96, dtype=dtype))  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 33])
def test_rotary_on_a_strided_view_is_bit_equal(ext, dtype: torch.dtype, t: int) -> None:  # type: ignore[no-untyped-def]
    qkv = rand(t, 7, 32, dtype=dtype)
    qk = qkv[:, :5]                                           # the q and k heads of a fused projection
    ang = torch.arange(t)[:, None].float() * torch.rand(16, generator=torch.Generator().manual_seed(3))
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got, ref = fused.rotary(qk, cos, sin), fused.rotary_reference(qk, cos, sin)
    # fp32: a fused multiply-add, and x*cos + rot*sin cancels, so an absolute bound
    assert torch.equal(got, ref) if dtype != torch.float32 else torch.allclose(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gu_dtype,round_dtype", [(torch.bfloat16, None), (torch.float16, None),
                                                  (torch.float32, None), (torch.float32, torch.bfloat16),
                                                  (torch.float32, torch.float16)])
@pytest.mark.parametrize("rows", [1, 20])
@pytest.mark.parametrize("width", [80, 83, 4864])  # 8-lane vectors only; a scalar tail; a model's width
def test_silu_mul(ext, gu_dtype: torch.dtype, round_dtype: torch.dtype | None, rows: int,  # type: ignore[no-untyped-def]
                  width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "SILU_NATIVE_ROWS", 1 << 30)  # the kernel for every row count here
    gu = 3 * rand(rows, 2 * width, dtype=gu_dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamped ends and zero
    got, ref = fused.silu_mul(gu, width, round_dtype), fused.silu_mul_reference(gu, width, round_dtype)
    assert got.dtype == gu_dtype and got.shape == (rows, width)
    assert ulps(got.to(round_dtype or gu_dtype), ref.to(round_dtype or gu_dtype)) <= TOL_ULPS[round_dtype or gu_dtype]
    if (round_dtype or gu_dtype) != torch.float32:
        assert (got == ref).float().mean() > 0.98


def test_silu_mul_leaves_many_rows_to_torch(ext, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The 8-lane loop runs a decode's few rows and torch's ops the rest; where the build has the
    16-lane loop, bf16 calls of every row count run the kernel (fp32 with bf16 rounding, the FBGEMM
    output's case, still goes to torch past the few rows)."""
    calls: list[int] = []
    real = ext.silu_mul
    monkeypatch.setattr(ext, "silu_mul", lambda *a: (calls.append(1), real(*a))[1])
    few = rand(fused.SILU_NATIVE_ROWS, 64, dtype=torch.float32)
    many = rand(fused.SILU_NATIVE_ROWS + 1, 64, dtype=torch.float32)
    fused.silu_mul(few, 32, torch.bfloat16)
    assert calls == [1]
    assert torch.equal(fused.silu_mul(many, 32, torch.bfloat16), fused.silu_mul_reference(many, 32, torch.bfloat16))
    assert calls == [1]
    wide = rand(300, 64, dtype=torch.bfloat16)
    got = fused.silu_mul(wide, 32)
    assert fused.silu_native_rows(torch.bfloat16) == (fused.SILU_WIDE_ROWS if ext.silu16() else fused.SILU_NATIVE_ROWS)
    assert calls == ([1, 1] if ext.silu16() else [1])
    assert ulps(got, fused.silu_mul_reference(wide, 32)) <= TOL_ULPS[torch.bfloat16]


def test_the_16_lane_silu_mul_is_bit_equal_to_the_8_lane_loop(ext) -> None:  # type: ignore[no-untyped-def]
    """A width of 24 runs both loops on one row (16 lanes for columns 0-15, then 8 for 16-23). The
    same values rotated by 8 columns in a second call move old columns 8-15 to the 8-lane loop and
    old 16-23 to the 16-lane one: every value comes out bit-equal whichever loop took it, because
    both run the same operations in the same order."""
    if not ext.silu16():
        pytest.skip("no 16-lane loop in this build")
    gu = 3 * rand(4, 48, dtype=torch.bfloat16)
    wide = fused.silu_mul(gu, 24)
    shifted = torch.cat([gu[:, 16:24], gu[:, :16], gu[:, 24 + 16:48], gu[:, 24:24 + 16]], dim=1)  # columns 0-15 -> 8-23
    out = fused.silu_mul(shifted.contiguous(), 24)
    assert torch.equal(out[:, 8:24], wide[:, :16])  # old 8-15: 8 lanes now, 16 before
    assert torch.equal(out[:, :8], wide[:, 16:24])  # old 16-23: 16 lanes now, 8 before


def test_switched_off_every_op_is_its_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setattr(native, "_why", {})
    monkeypatch.setenv("KVSERVE_NATIVE", "0")
    fused._ext.cache_clear()
    try:
        assert fused._ext() is None
        got = {(c.role, c.band): c for c in choices.choices()}[("fused_ops", "all")]
        assert got.choice == "torch" and "KVSERVE_NATIVE=0" in got.source
        x, w = rand(3, 64, dtype=torch.bfloat16), rand(64, dtype=torch.bfloat16, seed=1)
        assert torch.equal(fused.rms_norm(x, w, 1e-5), fused.rms_norm_reference(x, w, 1e-5))
        assert torch.equal(fused.add_rms_norm(x, x, w, 1e-5)[0], fused.add_rms_norm_reference(x, x, w, 1e-5)[0])
        gu = rand(2, 64, dtype=torch.float32)
        assert torch.equal(fused.silu_mul(gu, 32, torch.bfloat16), fused.silu_mul_reference(gu, 32, torch.bfloat16))
    finally:
        fused._ext.cache_clear()  # the next call finds the real build again (monkeypatch restores it)


def test_tensors_that_want_a_gradient_take_the_reference(ext) -> None:  # type: ignore[no-untyped-def]
    x = rand(2, 32, dtype=torch.float32).requires_grad_()
    w = torch.ones(32)
    fused.rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None


def int8_regions(nb: int, bs: int, kvh: int, d: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from kvserve.kv.codec_pairs import field_views
    from kvserve.kv.quant import Int8Codec

    specs = Int8Codec().fields(bs, kvh, d)
    offs = [0, specs[0].nbytes]
    region = torch.zeros(nb, sum(f.nbytes for f in specs) + 8, dtype=torch.uint8)  # + 8: a row is wider
    return region, field_views(region, tuple(zip(specs, offs, strict=True)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", [(7, 64), (7, 40), (37, 128)])  # d 40: the scalar rows (not 16-wide)
def test_int8_write_is_the_codecs_encode_and_scatter_bit_for_bit(ext, dtype: torch.dtype, t: int, d: int) -> None:  # type: ignore[no-untyped-def]
    from kvserve.kv.layer_kv import put_tokens
    from kvserve.kv.quant import Int8Codec

    kvh = 2
    x = (rand(t, kvh, d, dtype=dtype) * 3).to(dtype)
    x[1, 0] = 0  # amax 0: the floor scale, all-zero codes
    x[2, 1, :4] = torch.tensor([127.0, 63.5, -0.5, 1.5]).to(dtype)  # ties at x/scale = k + 0.5: half to even
    x[3, 0] *= 1000
    x[4, 1, 5] = -x[4, 1].abs().max() * 2  # the row's largest magnitude negative
    if t == 7:
        blocks = torch.tensor([5, 0, 3, 3, 9, 1, 5])
        offsets = torch.tensor([0, 2, 1, 3, 2, 0, 3])
    else:  # more tokens than one thread's share: written in parallel, each to its own slot
        slots = torch.randperm(40, generator=torch.Generator().manual_seed(t))[:t]
        blocks, offsets = slots // 4, slots % 4
    mine, views = int8_regions(10, 4, kvh, d)
    ref, ref_views = int8_regions(10, 4, kvh, d)
    assert fused.int8_write(x, views, blocks, offsets)
    put_tokens(ref_views, Int8Codec().encode_tokens(x), blocks, offsets)
    assert torch.equal(mine, ref)  # every code, every scale, and nothing written outside the slots


def test_int8_write_declines_where_it_cannot_run(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _, views = int8_regions(2, 4, 2, 8)
    x = torch.randn(2, 2, 8)
    assert not fused.int8_write(x.transpose(0, 1), views, torch.tensor([0, 1]), torch.tensor([0, 0]))  # strided
    assert not fused.int8_write(x, views, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 0]))
    monkeypatch.setattr(fused, "_ext", lambda: None)  # KVSERVE_NATIVE=0, no compiler, a failed build
    assert not fused.int8_write(x, views, torch.tensor([0, 1]), torch.tensor([0, 0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_rope_write_equals_rotary_then_index_copy(ext, dtype: torch.dtype, tokens: int) -> None:
    """The fused prologue returns the reference's queries and leaves the pool exactly as the
    reference's rotary + index_copy_ leave it (untouched slots included), bit for bit."""
    heads, kv_heads, d, blocks, bs = 6, 2, 16, 13, 4
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, d, generator=g).to(dtype)
    pos = torch.randint(0, 500, (tokens,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.cat([pos[:, None] * inv[None]] * 2, dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    pool = torch.randn(2, blocks, bs, kv_heads, d, generator=g).to(dtype)
    want_pool = pool.clone()
    want_q = fused.rope_write_reference(qkv, heads, kv_heads, cos, sin, want_pool, slots)
    got_q = fused.rope_write(qkv, heads, kv_heads, cos, sin, pool, slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(pool, want_pool)
    bad = torch.tensor([blocks * bs] + [0] * (tokens - 1))
    with pytest.raises(RuntimeError, match="slot out of range"):
        fused.rope_write(qkv, heads, kv_heads, cos, sin, pool, bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_rope_int8_write_equals_rotary_then_the_codecs_encode(ext, dtype: torch.dtype, tokens: int) -> None:  # type: ignore[no-untyped-def]
    """The int8 pool's fused prologue: the reference's queries, and the K and V regions exactly as
    rotary + the codec's encode and scatter leave them (other slots untouched), bit for bit."""
    from kvserve.kv.layer_kv import put_tokens
    from kvserve.kv.quant import Int8Codec

    heads, kv_heads, d, nb, bs = 6, 2, 16, 13, 4
    g = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, d, generator=g) * 3).to(dtype)
    pos = torch.randint(0, 500, (tokens,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.cat([pos[:, None] * inv[None]] * 2, dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    slots = torch.randperm(nb * bs, generator=g)[:tokens]
    blocks, offsets = slots // bs, slots % bs
    regions = {n: int8_regions(nb, bs, kv_heads, d) for n in ("k", "v", "ref_k", "ref_v")}
    for region, _ in regions.values():
        region.copy_(torch.randint(0, 256, region.shape, generator=g, dtype=torch.uint8))
    regions["ref_k"][0].copy_(regions["k"][0])
    regions["ref_v"][0].copy_(regions["v"][0])
    got_q = fused.rope_int8_write(qkv, heads, kv_heads, cos, sin, regions["k"][1], regions["v"][1], blocks, offsets)
    qk = fused.rotary(qkv[:, :heads + kv_heads], cos, sin)
    put_tokens(regions["ref_k"][1], Int8Codec().encode_tokens(qk[:, heads:]), blocks, offsets)
    put_tokens(regions["ref_v"][1], Int8Codec().encode_tokens(qkv[:, heads + kv_heads:]), blocks, offsets)
    assert got_q is not None and torch.equal(got_q, qk[:, :heads])
    assert torch.equal(regions["k"][0], regions["ref_k"][0])
    assert torch.equal(regions["v"][0], regions["ref_v"][0])
    with pytest.raises(RuntimeError, match="slot out of range"):
        fused.rope_int8_write(qkv, heads, kv_heads, cos, sin, regions["k"][1], regions["v"][1],
                              torch.full_like(blocks, nb), offsets)
