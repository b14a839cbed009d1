"""The native paged-attention kernel against a dense reference and the torch path.

Decode batches and prefill chunks with ragged lengths, block tables in random (non-contiguous)
order and blocks shared between sequences, GQA ratios 1/2/7, sliding windows, the float pools
and every codec (through :class:`~kvserve.kv.storage.KVStorage`, shadows included), and the
fallbacks: KVSERVE_NATIVE=0, sequences with sinks/scores, a pool holding two codecs.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from kvserve.kv.codec_names import parse_layer_codecs
from kvserve.kv.layer_kv import as_layer_kv
from kvserve.kv.quant import parse_kv_codecs
from kvserve.kv.storage import KVStorage
from kvserve.model import attention, attention_native
from kvserve.model.attention import AttentionMetadata
from kvserve.model.attention_native import NativePagedBackend, kv_source, native_module

D, BS, NB = 8, 4, 96

pytestmark = pytest.mark.skipif(native_module() is None, reason=f"no native kernel: "
                                f"{attention_native.unavailable_reason()}")


@pytest.fixture(params=["tiled", "scalar"])
def impl(request, monkeypatch):
    """Both kernel paths: the tiled one (AVX2 + FMA builds, head_dim % 8 == 0; skipped where the
    build lacks it) and the scalar one. (The bf16-dot path has its own tests below.)"""
    if request.param == "tiled" and not native_module().tiled_available():
        pytest.skip("this build has no tiled path (no AVX2 + FMA)")
    monkeypatch.setattr(attention_native, "IMPL", 2 if request.param == "tiled" else 1)
    return request.param


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None) -> torch.Tensor:
    """softmax(q kᵀ / √d) v with the causal/window mask; q ``[n, H, D]`` at the last n positions."""
    n, heads = q.shape[:2]
    g = heads // keys.shape[1]
    k = keys.float().repeat_interleave(g, 1).transpose(0, 1)
    v = values.float().repeat_interleave(g, 1).transpose(0, 1)
    s = q.float().transpose(0, 1) @ k.transpose(1, 2) * q.shape[-1] ** -0.5
    qp, kp = torch.arange(len(keys) - n, len(keys))[:, None], torch.arange(len(keys))[None, :]
    ok = kp <= qp
    if window is not None:
        ok &= kp > qp - window
    return (s.masked_fill(~ok, float("-inf")).softmax(-1) @ v).transpose(0, 1)


def tables_for(specs: list[tuple[int, int]], share: bool, g: torch.Generator) -> list[torch.Tensor]:
    """Random block ids per sequence; with ``share`` every sequence starts with sequence 0's
    first block (a shared prefix block: its contents are written once, by sequence 0)."""
    free = torch.randperm(NB, generator=g).tolist()
    out = []
    for done, new in specs:
        n = -(-(done + new) // BS)
        t, free = free[:n], free[n:]
        if share and out and done >= BS:
            t[0] = int(out[0][0])
        out.append(torch.tensor(t))
    return out


def run_plain(specs, heads, kvh, window, dtype, share=False, seed=0, d=D):
    g = torch.Generator().manual_seed(seed)
    cache = torch.full((2, NB, BS, kvh, d), float("nan"), dtype=dtype)
    tables = tables_for(specs, share, g)
    hist, qs, ks, vs, slots, qsl = [], [], [], [], [], [0]
    for i, (done, new) in enumerate(specs):
        total = done + new
        keys, values = torch.randn(total, kvh, d, generator=g), torch.randn(total, kvh, d, generator=g)
        if share and i and done >= BS:  # the shared block holds sequence 0's first tokens
            keys[:BS], values[:BS] = hist[0][0][:BS].float(), hist[0][1][:BS].float()
        keys, values = keys.to(dtype), values.to(dtype)
        for p in range(done):
            cache[0, tables[i][p // BS], p % BS] = keys[p]
            cache[1, tables[i][p // BS], p % BS] = values[p]
        hist.append((keys, values))
        qs.append(torch.randn(new, heads, d, generator=g).to(dtype))
        ks.append(keys[done:])
        vs.append(values[done:])
        slots += [int(tables[i][p // BS]) * BS + p % BS for p in range(done, total)]
        qsl.append(qsl[-1] + new)
    meta = AttentionMetadata(torch.tensor(slots), qsl, [d + n for d, n in specs], tables, BS, window)
    q = torch.cat(qs)
    assert kv_source(as_layer_kv(cache)) is not None
    torch_out = attention.paged_attention(q, torch.cat(ks), torch.cat(vs), cache.clone(),
                                          AttentionMetadata(torch.tensor(slots), qsl, meta.seq_lens, tables, BS,
                                                            window), d ** -0.5)
    out = NativePagedBackend().forward(q, torch.cat(ks), torch.cat(vs), cache, meta, d ** -0.5)
    return out, torch_out, [reference(qs[i], *hist[i], window) for i in range(len(specs))], qsl


CASES = {
    "decodes-ragged": [(3, 1), (17, 1), (8, 1), (1, 1), (30, 1)],
    "prefill-chunks": [(0, 7), (12, 1), (5, 11), (20, 1), (0, 1), (9, 16)],
    "single-decode": [(41, 1)],
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,kvh", [(2, 2), (4, 2), (7, 1), (14, 2)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_plain_pool_matches_reference_and_torch_path(case, window, heads, kvh, dtype, impl):
    out, torch_out, refs, qsl = run_plain(CASES[case], heads, kvh, window, dtype, share=True)
    assert not out.isnan().any()
    for i, ref in enumerate(refs):
        got = out[qsl[i]:qsl[i + 1]].float()
        torch.testing.assert_close(got, ref, atol=TOL[dtype], rtol=TOL[dtype], msg=f"sequence {i}")
    torch.testing.assert_close(out.float(), torch_out.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_head_dims_with_a_compiled_width(d, dtype, impl):
    """head_dim 64 and 128 run the kernel instantiated for that width (the others a generic one)."""
    out, torch_out, refs, qsl = run_plain(CASES["prefill-chunks"], 14, 2, 5, dtype, share=True, d=d)
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.float(), torch_out.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("bs", [16, 40])
@pytest.mark.parametrize("d", [8, 24])
def test_blocks_of_one_and_several_key_tiles(bs, d, impl, monkeypatch):
    """Block size 16 (one 16-key tile per block) and 40 (tiles of 16, 16, 8 inside a block),
    head_dim 8 and 24 (the 8-wide tail of the V sums), a window that starts inside a tile."""
    monkeypatch.setattr(sys.modules[__name__], "BS", bs)
    specs = [(70, 1), (3, 1), (45, 9), (0, 20), (81, 1)]
    for window in (None, 23):
        out, _, refs, qsl = run_plain(specs, 14, 2, window, torch.float32, share=True, d=d)
        for i, ref in enumerate(refs):
            torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref, atol=1e-5, rtol=1e-5, msg=f"sequence {i}")


needs_bf16dot = pytest.mark.skipif(native_module() is None or not native_module().bf16dot_available(),
                                   reason="this build has no bf16-dot path (no AVX512-BF16)")


@needs_bf16dot
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("heads,kvh", [(8, 2), (14, 2), (4, 4)])
@pytest.mark.parametrize("window", [None, 23])
def test_bf16_dot_path_matches_reference_and_tiled_path(d, heads, kvh, window, monkeypatch):
    """bf16 queries on the bf16 pool, head_dim a multiple of 32: the AVX512-BF16 path (exact bf16
    products for the scores, probabilities rounded to bf16 for the values) against the fp32
    reference and the tiled path, over blocks of 16 (one tile each), decodes and chunks of up to
    33 tokens over up to 150 cached ones, a window starting inside a tile, shared prefix blocks."""
    monkeypatch.setattr(sys.modules[__name__], "BS", 16)
    specs = [(70, 1), (3, 1), (45, 9), (0, 20), (81, 1), (150, 33)]
    monkeypatch.setattr(attention_native, "IMPL", 0)
    out, torch_out, refs, qsl = run_plain(specs, heads, kvh, window, torch.bfloat16, share=True, d=d)
    monkeypatch.setattr(attention_native, "IMPL", 2)
    tiled, _, _, _ = run_plain(specs, heads, kvh, window, torch.bfloat16, share=True, d=d)
    assert not out.isnan().any()
    assert not torch.equal(out, tiled)  # another path ran (the tiled one sums fp32 probabilities)
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float(), ref, atol=2e-2, rtol=2e-2, msg=f"sequence {i}")
    torch.testing.assert_close(out.float(), tiled.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), torch_out.float(), atol=2e-2, rtol=2e-2)


needs_amx = pytest.mark.skipif(native_module() is None or not native_module().amx_available(),
                               reason="the bf16-dot path has no AMX tiles here (no AMX-BF16, or the OS refused them)")


@needs_amx
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("heads,kvh", [(8, 2), (14, 2), (4, 4), (3, 1)])
@pytest.mark.parametrize("window", [None, 23])
def test_amx_tiles_match_the_vdpbf16ps_products(d, heads, kvh, window, monkeypatch):
    """The bf16-dot path's scores and V sums on AMX tiles (IMPL 0 where usable) against the same
    path on vdpbf16ps (IMPL 4) and the fp32 reference: the same bf16 products and probabilities,
    summed in fp32 in another order, so at most a bf16 rounding step apart. Rows per task 8 x g (one partial 16-row block or
    several), flushes of 1-8 key tiles (odd counts: a zeroed half chunk), decodes, chunks of up to
    40 tokens over up to 300 cached ones, a window starting inside a tile, shared prefix blocks."""
    monkeypatch.setattr(sys.modules[__name__], "BS", 16)
    specs = [(70, 1), (3, 1), (45, 9), (0, 20), (81, 1), (150, 33), (300, 40), (17, 16)]
    outs, calls = {}, {}
    for impl in (0, 4):
        monkeypatch.setattr(attention_native, "IMPL", impl)
        before = native_module().amx_calls()
        outs[impl] = run_plain(specs, heads, kvh, window, torch.bfloat16, share=True, d=d)
        calls[impl] = native_module().amx_calls() - before
    assert calls == {0: 1, 4: 0}  # the tiles ran for IMPL 0 only
    out, _, refs, qsl = outs[0]
    assert not out.isnan().any()
    torch.testing.assert_close(out, outs[4][0], atol=4e-3, rtol=8e-3)  # a bf16 rounding step apart at most
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float(), ref, atol=2e-2, rtol=2e-2, msg=f"sequence {i}")


@needs_amx
@pytest.mark.parametrize("pool", ["int8", "fp8"])
@pytest.mark.parametrize("min_tokens", [0, 12])
def test_amx_tiles_on_int8_and_fp8_pools(pool, min_tokens, monkeypatch):
    """The int8 / fp8 pools (codes widened to bf16, per-token scales on scores and probabilities)
    and their shadows through the AMX products (IMPL 3: never the int8-dot path) against the
    vdpbf16ps ones (IMPL 4; a rounding step apart) and the reference on what the codec stored."""
    monkeypatch.setattr(sys.modules[__name__], "BS", 16)
    specs = [(3, 1), (20, 1), (5, 4), (40, 17), (70, 1), (130, 35)]
    outs, calls = {}, {}
    for impl in (3, 4):
        monkeypatch.setattr(attention_native, "IMPL", impl)
        before = native_module().amx_calls()
        outs[impl] = drive(storage(pool, torch.bfloat16, 2, window_blocks=48, min_tokens=min_tokens, d=64),
                           specs, 14, None)
        calls[impl] = native_module().amx_calls() - before
    assert calls[3] > 0 and calls[4] == 0
    out, _, refs, qsl, _ = outs[3]
    torch.testing.assert_close(out, outs[4][0], atol=4e-3, rtol=8e-3)
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float(), ref, atol=3e-2, rtol=3e-2, msg=f"sequence {i}")


@needs_bf16dot
def test_the_bf16_dot_path_leaves_other_cases_to_the_tiled_path(monkeypatch):
    """fp32 and fp16 queries, and a head_dim that is not a multiple of 32, run the tiled path
    whatever IMPL allows: bit for bit its output. (int4 pools: the same, below.)"""
    for dtype, d in ((torch.float32, 64), (torch.float16, 64), (torch.bfloat16, 24)):
        outs = []
        for impl in (0, 2):
            monkeypatch.setattr(attention_native, "IMPL", impl)
            outs.append(run_plain(CASES["prefill-chunks"], 14, 2, None, dtype, share=True, d=d)[0])
        assert torch.equal(outs[0], outs[1]), (dtype, d)
    outs = []
    for impl in (0, 2):
        monkeypatch.setattr(attention_native, "IMPL", impl)
        outs.append(drive(storage("int4", torch.bfloat16, 2, window_blocks=48, sinks=2, d=64), CODEC_SPECS, 14, None)[0])
    assert torch.equal(outs[0], outs[1])


def test_shared_blocks_are_read_by_every_sequence():
    specs = [(9, 1), (9, 1), (13, 4)]
    out, _, refs, qsl = run_plain(specs, 4, 2, None, torch.float32, share=True, seed=3)
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref, atol=1e-5, rtol=1e-5)


# -- codecs through KVStorage ---------------------------------------------------------------------

def storage(pool: str, dtype: torch.dtype, kvh: int, window_blocks: int = 0, min_tokens: int = 0,
            sinks: int = 0, d: int = D) -> KVStorage:
    return KVStorage(num_layers=1, num_blocks=NB, block_size=BS, kv_heads=kvh, head_dim=d, dtype=dtype,
                     pool=parse_kv_codecs(pool, "float32" if dtype == torch.float32 else "bfloat16"),
                     group_size=BS, window_blocks=window_blocks, min_tokens=min_tokens, sink_tokens=sinks)


def drive(s: KVStorage, specs, heads, window, seed=0, codecs=None, layer_index=0):
    """Write each sequence's context in one earlier step, then run the test step through the
    native backend; returns (native out, torch-path out on the same cache, references, qsl)."""
    g = torch.Generator().manual_seed(seed)
    kvh, hd = s.kv_heads, s.head_dim
    tables = tables_for(specs, False, g)
    hist = [(torch.randn(d + n, kvh, hd, generator=g).to(s.dtype) * 2,
             torch.randn(d + n, kvh, hd, generator=g).to(s.dtype)) for d, n in specs]
    codecs = codecs or [None] * len(specs)

    def step(rng):
        chunks = [SimpleNamespace(start=a, end=b, block_ids=tuple(int(x) for x in t))
                  for (a, b), t in zip(rng, tables) if b > a]
        cs = [c for (a, b), c in zip(rng, codecs) if b > a]
        s.begin_step(chunks, cs)
        return chunks

    first = step([(0, d) for d, _ in specs])
    if first:
        rows = [(i, d) for i, (d, _) in enumerate(specs) if d]
        k = torch.cat([hist[i][0][:d] for i, d in rows])
        v = torch.cat([hist[i][1][:d] for i, d in rows])
        first_slots = torch.tensor([int(tables[i][p // BS]) * BS + p % BS for i, d in rows for p in range(d)])
        s.layers()[layer_index].write(k, v, first_slots)
        s.end_step()
    step([(d, d + n) for d, n in specs])
    layer = s.layers()[layer_index]
    qsl = [0]
    for _, n in specs:
        qsl.append(qsl[-1] + n)
    slots = torch.tensor([int(tables[i][p // BS]) * BS + p % BS for i, (d, n) in enumerate(specs) for p in range(d, d + n)])
    meta = AttentionMetadata(slots, qsl, [d + n for d, n in specs], tables, BS, window)
    q = torch.randn(qsl[-1], heads, hd, generator=g).to(s.dtype)
    k = torch.cat([hist[i][0][d:] for i, (d, _) in enumerate(specs)])
    v = torch.cat([hist[i][1][d:] for i, (d, _) in enumerate(specs)])
    out = NativePagedBackend().forward(q, k, v, layer, meta, hd ** -0.5)
    plan = attention.plan_step(meta, layer.shape, q.device)
    torch_out = attention.attend_written(q, layer, meta, plan, hd ** -0.5, torch.empty_like(q))
    refs = []
    for i, (d, n) in enumerate(specs):  # the reference reads what the codec stored (decoded)
        kv = layer.gather_blocks(tables[i][: -(-(d + n) // BS)])
        kv = kv.reshape(2, -1, kvh, hd)[:, : d + n]
        refs.append(reference(q[qsl[i]:qsl[i + 1]], kv[0], kv[1], window))
    src = kv_source(layer)
    s.end_step()
    return out, torch_out, refs, qsl, src


CODEC_SPECS = [(3, 1), (17, 1), (6, 9), (0, 5), (22, 1)]


@pytest.mark.parametrize("pool", ["int8", "fp8", "int4", "k:int8,v:fp8", "k:int4,v:int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kvh,window", [(4, 2, None), (7, 1, 5), (2, 2, None)])
def test_codec_pool_matches_reference_and_torch_path(pool, dtype, heads, kvh, window, impl):
    int4 = "int4" in pool
    s = storage(pool, dtype, kvh, window_blocks=48 if int4 else 0, sinks=2 if int4 else 0)
    out, torch_out, refs, qsl, src = drive(s, CODEC_SPECS, heads, window)
    assert src is not None, "the kernel must read this pool itself"
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float(), ref, atol=tol, rtol=tol, msg=f"sequence {i}")
    torch.testing.assert_close(out.float(), torch_out.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("layer_index", [0, 1])
def test_a_per_layer_map_is_read_with_each_layers_own_codecs(layer_index):
    """A ``layers:`` pool (kvserve.kv.codec_names): pair 0 is the whole map, so the kernel must
    read each layer's fields with that layer's pair (int8 on layer 0, fp8 K + int8 V on 1)."""
    s = KVStorage(num_layers=2, num_blocks=NB, block_size=BS, kv_heads=2, head_dim=D, dtype=torch.float32,
                  pool=parse_layer_codecs("layers:int8/k:fp8,v:int8", "float32", 2), group_size=BS)
    out, torch_out, refs, qsl, src = drive(s, CODEC_SPECS, 4, None, layer_index=layer_index)
    assert src is not None, "the kernel must read this pool itself"
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref, atol=1e-4, rtol=1e-4, msg=f"sequence {i}")
    torch.testing.assert_close(out, torch_out, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pool", ["int8", "fp8", "int4"])
def test_codecs_at_head_dim_64(pool, impl):
    s = storage(pool, torch.bfloat16, 2, window_blocks=48 if pool == "int4" else 0, d=64)
    out, torch_out, refs, qsl, src = drive(s, CODEC_SPECS, 14, None)
    assert src is not None
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float(), ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), torch_out.float(), atol=3e-2, rtol=3e-2)


def test_short_sequences_read_their_shadows(impl):
    """kv_quant_min_tokens: a sequence shorter than it reads full-precision shadows, a longer one
    its int8 blocks; the kernel reads both kinds in one call."""
    s = storage("int8", torch.float32, 2, window_blocks=48, min_tokens=12)
    out, torch_out, refs, qsl, src = drive(s, [(3, 1), (20, 1), (5, 4)], 4, None)
    assert src is not None and src.shadow[0].numel() > 0
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)


@needs_bf16dot
@pytest.mark.parametrize("pool", ["int8", "fp8", "k:int8,v:fp8"])
@pytest.mark.parametrize("d,bs", [(32, 4), (64, 16)])
@pytest.mark.parametrize("min_tokens", [0, 12])
def test_bf16_dot_path_reads_int8_and_fp8_pools(pool, d, bs, min_tokens, monkeypatch):
    """The bf16-dot path on the int8 / fp8 pools (codes widened to bf16 exactly, the per-token
    scale on the scores and the probabilities), with and without full-precision shadows for short
    sequences: against the reference on what the codec stored and the tiled path. (IMPL 3: the
    int8-dot path, which IMPL 0 takes on int8 pools without shadows, is tested below.)"""
    monkeypatch.setattr(sys.modules[__name__], "BS", bs)
    specs = [(3, 1), (20, 1), (5, 4), (40, 17), (70, 1)]
    outs = {}
    for impl in (3, 2):
        monkeypatch.setattr(attention_native, "IMPL", impl)
        s = storage(pool, torch.bfloat16, 2, window_blocks=48, min_tokens=min_tokens, d=d)
        outs[impl] = drive(s, specs, 14, None)
    out, torch_out, refs, qsl, src = outs[3]
    assert src is not None and (src.shadow[0].numel() > 0) == (min_tokens > 0)
    assert not torch.equal(out, outs[2][0])  # another path ran
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float(), ref, atol=3e-2, rtol=3e-2, msg=f"sequence {i}")
    torch.testing.assert_close(out.float(), outs[2][0].float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), torch_out.float(), atol=3e-2, rtol=3e-2)


needs_int8dot = pytest.mark.skipif(native_module() is None or not native_module().int8dot_available(),
                                   reason="this build has no int8-dot path (no AVX512-VNNI + BF16)")


@needs_int8dot
@pytest.mark.parametrize("d,bs", [(32, 4), (64, 16), (128, 16), (64, 40)])
@pytest.mark.parametrize("heads,kvh", [(14, 2), (4, 4)])
@pytest.mark.parametrize("window", [None, 37])
def test_int8_dot_path_matches_reference_bf16_dot_and_tiled_paths(d, bs, heads, kvh, window, monkeypatch):
    """bf16 queries on an int8 pool without shadows: the VNNI path (queries rounded to int16 per
    row, integer dot products on the codes; probabilities rounded to int16 per 128-key group for
    the V sums) against the reference on what the codec stored, the bf16-dot path (IMPL 3) and
    the tiled path (IMPL 2): decodes, chunks of up to 33 tokens over up to 300 cached ones (more
    than one 128-key group), a window starting inside a tile, blocks of 4, 16 and 40 keys."""
    monkeypatch.setattr(sys.modules[__name__], "BS", bs)
    monkeypatch.setattr(sys.modules[__name__], "NB", 160)
    specs = [(3, 1), (20, 1), (5, 4), (40, 17), (150, 33), (300, 1), (0, 9)]
    outs = {}
    for impl in (0, 3, 2):
        monkeypatch.setattr(attention_native, "IMPL", impl)
        outs[impl] = drive(storage("int8", torch.bfloat16, kvh, d=d), specs, heads, window)
    out, torch_out, refs, qsl, src = outs[0]
    assert src is not None and src.shadow[0].numel() == 0
    assert not out.isnan().any()
    assert not torch.equal(out, outs[3][0]) and not torch.equal(out, outs[2][0])  # another path ran
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float(), ref, atol=3e-2, rtol=3e-2, msg=f"sequence {i}")
    for other in (outs[3][0], outs[2][0], torch_out):
        torch.testing.assert_close(out.float(), other.float(), atol=3e-2, rtol=3e-2)


@needs_int8dot
def test_the_int8_dot_path_leaves_shadows_fp32_and_wide_heads_to_the_others(monkeypatch):
    """Shadows (kv_quant_min_tokens), fp32 queries and head_dim 160 on an int8 pool: IMPL 0 gives
    bit for bit what IMPL 3 (never int8-dot) gives."""
    monkeypatch.setattr(sys.modules[__name__], "BS", 16)
    for dtype, d, min_tokens in ((torch.bfloat16, 64, 12), (torch.float32, 64, 0), (torch.bfloat16, 160, 0)):
        outs = []
        for impl in (0, 3):
            monkeypatch.setattr(attention_native, "IMPL", impl)
            s = storage("int8", dtype, 2, window_blocks=48 if min_tokens else 0, min_tokens=min_tokens, d=d)
            out, _, _, _, src = drive(s, CODEC_SPECS, 14, None)
            assert src is not None and (src.shadow[0].numel() > 0) == (min_tokens > 0)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), (dtype, d, min_tokens)


def test_two_codecs_in_one_pool_fall_back_to_the_torch_path():
    s = storage("bf16", torch.float32, 2)
    out, torch_out, refs, qsl, src = drive(s, [(5, 1), (9, 1), (4, 3)], 4, None, codecs=[None, "int8", None])
    assert src is None
    torch.testing.assert_close(out, torch_out)
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref, atol=1e-5, rtol=1e-5)


def test_sequences_with_sinks_or_scores_take_the_torch_path_beside_the_kernel():
    """A sequence with sinks (window + sinks) goes through attention_kept; the others through
    the kernel, in the same layer call."""
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, NB, BS, 2, D, generator=g)
    tables = [torch.arange(0, 6), torch.arange(10, 16)]
    meta = AttentionMetadata(torch.tensor([21, 62]), [0, 1, 2], [22, 23], tables, BS, None,
                             seq_windows=[None, 8], seq_sinks=[0, 2])
    plan = attention_native.plan_native(meta)
    assert plan.seqs == [0] and plan.kept == [1]
    q, kv = torch.randn(2, 4, D, generator=g), torch.randn(2, 2, D, generator=g)
    out = NativePagedBackend().forward(q, kv, kv, cache.clone(), meta, D ** -0.5)
    ref = attention.paged_attention(q, kv, kv, cache.clone(), AttentionMetadata(
        torch.tensor([21, 62]), [0, 1, 2], [22, 23], tables, BS, None, seq_windows=[None, 8], seq_sinks=[0, 2]),
        D ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_without_the_extension_the_backend_is_the_torch_path(monkeypatch):
    """KVSERVE_NATIVE=0 (or no compiler): the backend computes the same thing through torch."""
    from kvserve import native

    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setattr(native, "_why", {})
    monkeypatch.setenv("KVSERVE_NATIVE", "0")
    backend = NativePagedBackend()
    assert backend.module is None and attention_native.unavailable_reason() == "KVSERVE_NATIVE=0"
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, NB, BS, 2, D, generator=g)
    tables = [torch.arange(0, 4), torch.arange(20, 24)]
    meta = AttentionMetadata(torch.tensor([9, 85, 86]), [0, 1, 3], [10, 7], tables, BS)
    q, kv = torch.randn(3, 4, D, generator=g), torch.randn(3, 2, D, generator=g)
    out = backend.forward(q, kv, kv, cache.clone(), meta, D ** -0.5)
    ref = attention.paged_attention(q, kv, kv, cache.clone(), AttentionMetadata(
        torch.tensor([9, 85, 86]), [0, 1, 3], [10, 7], tables, BS), D ** -0.5)
    torch.testing.assert_close(out, ref)
