"""KVStorage without a model: what a sequence reads back after writes through a codec.

Sequences are driven step by step with chunks (prefill chunks and single-token decodes); after
each step every sequence's whole context is gathered and compared with what the codec promises:
exact for identity codecs, the shadow (full precision) where one applies, the codec's round trip
elsewhere. Storage's own bookkeeping is checked after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from kvserve.contract import CopyBlock
from kvserve.kv import layout
from kvserve.kv.quant import Int4ChannelCodec, make_codec, parse_kv_codecs
from kvserve.kv.storage import KVStorage

BS, KVH, D, NB = 4, 2, 8, 64


def make_storage(pool: str = "int8", window: int = 0, min_tokens: int = 0, sinks: int = 0,
                 layers: int = 2, dtype: torch.dtype = torch.float32, num_blocks: int = NB) -> KVStorage:
    return KVStorage(num_layers=layers, num_blocks=num_blocks, block_size=BS, kv_heads=KVH, head_dim=D,
                     dtype=dtype, pool=parse_kv_codecs(pool, "float32"), group_size=BS,
                     window_blocks=window, min_tokens=min_tokens, sink_tokens=sinks)


@dataclass
class Seq:
    table: tuple[int, ...]
    codec: str | None = None
    keys: list[torch.Tensor] = field(default_factory=list)    # per layer [L, KVH, D]
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0


class Driver:
    """Runs steps on a storage with random K/V, remembering each sequence's exact history."""

    def __init__(self, storage: KVStorage, seed: int = 0) -> None:
        self.s = storage
        self.g = torch.Generator().manual_seed(seed)
        self.free = list(torch.randperm(storage.num_blocks, generator=self.g).tolist())

    def new_seq(self, max_len: int, codec: str | None = None) -> Seq:
        n = -(-max_len // BS)
        table, self.free = tuple(self.free[:n]), self.free[n:]
        return Seq(table, codec)

    def step(self, work: list[tuple[Seq, int]]) -> None:
        chunks, ks, vs = [], [[] for _ in range(self.s.num_layers)], [[] for _ in range(self.s.num_layers)]
        codecs: list[str | None] = []
        for seq, n in work:
            start = seq.length
            chunks.append(SimpleNamespace(start=start, end=start + n, block_ids=seq.table))
            codecs.append(seq.codec)
            for layer in range(self.s.num_layers):
                k = torch.randn(n, KVH, D, generator=self.g) * 2
                k[..., 1] += 6  # an outlier channel, as in real keys
                v = torch.randn(n, KVH, D, generator=self.g)
                ks[layer].append(k)
                vs[layer].append(v)
                if layer == len(seq.keys):
                    seq.keys.append(k)
                    seq.values.append(v)
                else:
                    seq.keys[layer] = torch.cat((seq.keys[layer], k))
                    seq.values[layer] = torch.cat((seq.values[layer], v))
        self.s.begin_step(chunks, codecs)
        layers = self.s.layers()
        for layer in range(self.s.num_layers):
            lk = layers[layer]
            k, v = torch.cat(ks[layer]), torch.cat(vs[layer])
            slots = torch.tensor([c.block_ids[p // BS] * BS + p % BS for c in chunks for p in range(c.start, c.end)])
            lk.write(k, v, slots)  # a plain layer writes by slot; a codec layer follows the step's plan
        self.reads = {id(seq): [self.read(seq, layer) for layer in range(self.s.num_layers)] for seq, _ in work}
        self.s.end_step()
        self.s.check()

    def read(self, seq: Seq, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        lk = self.s._layers[layer]
        return lk.gather(torch.tensor(seq.table), seq.length)


def codec_round_trip(name: str, side: str, x: torch.Tensor, full_blocks: int, tail_exact: bool = False) -> torch.Tensor:
    """Reference: per-token codecs token by token; int4 keys per block for full blocks only.
    ``tail_exact``: the unfinished block reads at full precision (K and V), as under int4 keys."""
    codec = make_codec(name, side, BS)
    if tail_exact:
        out = codec_round_trip(name, side, x, full_blocks)
        out[full_blocks * BS:] = x[full_blocks * BS:]
        return out
    if codec.grouped:
        out = x.clone()
        n = full_blocks * BS
        if n:
            out[:n] = codec.decode(codec.encode_blocks(x[:n].view(full_blocks, BS, KVH, D)), x.dtype).view(n, KVH, D)
        return out
    return codec.decode(codec.encode_tokens(x), x.dtype) if name not in ("fp32",) else x


def test_nbytes_equal_the_layout() -> None:
    for pool, window in (("bf16", 0), ("int8", 0), ("fp8", 5), ("int4", 7), ("k:int8,v:int4", 3)):
        s = make_storage(pool, window=window, layers=3, dtype=torch.bfloat16)
        per_token = layout.kv_block_bytes(3, KVH, D, layout.resolve_kv_dtype(pool), BS) // BS
        window_bytes = window * 2 * 3 * BS * KVH * D * 2
        assert s.nbytes == NB * BS * per_token + window_bytes
        assert s.window_nbytes == window_bytes


@pytest.mark.parametrize("pool", ["int8", "fp8", "int4", "k:int8,v:int4", "k:int4,v:fp8"])
def test_reads_follow_the_codec_from_the_start(pool: str) -> None:
    """min_tokens = 0, no sinks: every full block reads as the codec's round trip; int4's
    unfinished key group reads at full precision until its block fills."""
    s = make_storage(pool, window=3 * 3 if "int4" in pool else 0)
    d = Driver(s)
    a, b = d.new_seq(40), d.new_seq(40)
    schedule = [[(a, 7), (b, 1)], [(a, 1), (b, 5)], [(a, 4), (b, 1)], [(a, 1), (b, 1)], [(a, 9), (b, 6)],
                [(a, 1), (b, 1)]]
    spec = parse_kv_codecs(pool)
    for work in schedule:
        d.step(work)
        for seq, _ in work:
            full = seq.length // BS
            for layer in range(s.num_layers):
                k, v = d.read(seq, layer)  # after end_step: a block filled this step is quantized now
                tail = spec.k == "int4"  # KIVI: the unfinished group stays full precision, K and V
                ref_k = codec_round_trip(spec.k, "k", seq.keys[layer], full, tail)
                ref_v = codec_round_trip(spec.v, "v", seq.values[layer], full, tail)
                torch.testing.assert_close(k, ref_k, rtol=0, atol=1e-6)
                torch.testing.assert_close(v, ref_v, rtol=0, atol=1e-6)


def test_sink_tokens_read_at_full_precision() -> None:
    s = make_storage("int4", window=9, sinks=2)
    d = Driver(s)
    a = d.new_seq(30)
    for n in (6, 1, 5, 1, 9):
        d.step([(a, n)])
    k, v = d.read(a, 0)
    assert torch.equal(k[:2], a.keys[0][:2]) and torch.equal(v[:2], a.values[0][:2])
    assert not torch.equal(k[2:BS], a.keys[0][2:BS])  # past the sinks the first block is int4
    full = a.length // BS
    ref = codec_round_trip("int4", "k", a.keys[0], full, tail_exact=True)
    torch.testing.assert_close(k[BS:], ref[BS:], rtol=0, atol=1e-6)


def test_short_sequences_read_full_precision_then_switch_to_the_codec() -> None:
    """The threshold switch: below min_tokens reads are exact; from the step that reaches it, reads
    equal those of a sequence quantized from the start (the codec data was written all along)."""
    for pool in ("int8", "int4"):
        lazy = make_storage(pool, window=8, min_tokens=10)
        eager = make_storage(pool, window=8 if pool == "int4" else 0)
        dl, de = Driver(lazy, seed=3), Driver(eager, seed=3)
        sl, se = dl.new_seq(30), de.new_seq(30)
        for n in (3, 1, 1, 1, 1, 1, 2, 1, 5, 1, 1):
            dl.step([(sl, n)])
            de.step([(se, n)])
            assert torch.equal(sl.keys[1], se.keys[1])
            kl, vl = dl.read(sl, 1)
            ke, ve = de.read(se, 1)
            if sl.length < 10:
                assert torch.equal(kl, sl.keys[1]) and torch.equal(vl, sl.values[1])
            else:
                assert torch.equal(kl, ke) and torch.equal(vl, ve)
        assert lazy.num_shadows <= (1 if pool == "int4" else 0)  # only int4's unfinished group


def test_mixed_codecs_in_one_batch_read_as_their_own_codec() -> None:
    """A bf16 pool serving a default request, an int8 and an fp8 override in the same steps."""
    mixed = make_storage("bf16", dtype=torch.float32)
    d = Driver(mixed, seed=5)
    seqs = {None: d.new_seq(20), "int8": d.new_seq(20, "int8"), "fp8": d.new_seq(20, "fp8")}
    for n in (5, 1, 3):
        d.step([(s, n) for s in seqs.values()])
    assert not isinstance(mixed.layers()[0], torch.Tensor)  # the codec-aware path is in use
    for name, seq in seqs.items():
        k, v = d.read(seq, 0)
        if name is None:
            ref_k, ref_v = seq.keys[0].to(torch.bfloat16).float(), seq.values[0].to(torch.bfloat16).float()
        else:
            ref_k = codec_round_trip(name, "k", seq.keys[0], 0)
            ref_v = codec_round_trip(name, "v", seq.values[0], 0)
        torch.testing.assert_close(k, ref_k, rtol=0, atol=1e-6)
        torch.testing.assert_close(v, ref_v, rtol=0, atol=1e-6)


def test_plain_float_pool_keeps_the_classic_tensor_path() -> None:
    s = make_storage("bf16", dtype=torch.bfloat16)
    from kvserve.kv.layer_kv import PlainLayerKV

    layers = s.layers()
    assert all(isinstance(t, PlainLayerKV) and t.shape == (2, NB, BS, KVH, D) for t in layers)
    assert [t.tensor for t in layers] == s.plain  # the storage's own tensors, no copy
    assert s.window_blocks == 0 and s.nbytes == s.num_layers * 2 * NB * BS * KVH * D * 2


def test_override_must_fit_the_pool() -> None:
    s = make_storage("int8")
    assert s.pair_for("fp8") != 0 and s.pair_for("int8") == 0
    with pytest.raises(ValueError, match="more bytes per block"):
        s.pair_for("bf16")
    with pytest.raises(ValueError, match="int4"):
        s.pair_for("int4")  # unfinished key groups need a window this int8 pool does not have
    with pytest.raises(ValueError, match="valid"):
        s.pair_for("int3")


def test_copy_on_write_copies_bytes_state_and_shadow() -> None:
    s = make_storage("int4", window=6)
    d = Driver(s, seed=9)
    a = d.new_seq(12)
    d.step([(a, 6)])
    src, dst = a.table[1], d.free.pop()
    s.run_block_ops([CopyBlock(src, dst)])
    s.check()
    assert src in s.shadow_of and dst in s.shadow_of and s.fill[dst] == s.fill[src] == 2
    for layer in range(s.num_layers):
        lk = s._layers[layer]
        # the 2 rows written (the rest of the block is whatever the pool and shadow held: may be NaN)
        a, b = lk.gather_blocks(torch.tensor([src])), lk.gather_blocks(torch.tensor([dst]))
        assert torch.equal(a[:, :, :2], b[:, :, :2])


def test_a_small_window_reclaims_idle_shadows_and_seals_their_groups() -> None:
    """Three sequences with unfinished int4 groups but a window of two blocks: the idle one is
    sealed (its keys encoded over the tokens present) and still reads within int4 error."""
    s = make_storage("int4", window=2, layers=1)
    d = Driver(s, seed=11)
    a, b, c = d.new_seq(16), d.new_seq(16), d.new_seq(16)
    d.step([(a, 2)])
    d.step([(b, 2)])
    d.step([(c, 2)])      # a (least recently used) loses its shadow: sealed
    assert s.num_shadows == 2
    assert a.table[0] not in s.shadow_of
    k, _ = d.read(a, 0)
    x = a.keys[0]
    rng = x.amax(0) - x.amin(0)
    assert ((k - x).abs() <= rng / 30 * 1.01 + 1e-3).all()
    assert not torch.equal(k, x)
    d.step([(a, 3)])      # a resumes: unsealed into a shadow, finishes its group, keeps going
    k, _ = d.read(a, 0)
    assert k.shape == (5, KVH, D) and torch.isfinite(k).all()
    assert torch.equal(k[BS:], a.keys[0][BS:])  # its new unfinished group: exact


def test_window_exhausted_by_one_step_raises() -> None:
    s = make_storage("int4", window=1, layers=1)
    d = Driver(s)
    a, b = d.new_seq(8), d.new_seq(8)
    with pytest.raises(RuntimeError, match="window"):
        d.step([(a, 2), (b, 2)])


def test_int4_group_smaller_than_the_block() -> None:
    s = KVStorage(num_layers=1, num_blocks=8, block_size=8, kv_heads=1, head_dim=4, dtype=torch.float32,
                  pool=parse_kv_codecs("int4"), group_size=4, window_blocks=3)
    assert isinstance(s.pool.k, Int4ChannelCodec) and s.pool.k.group_size == 4
    chunk = SimpleNamespace(start=0, end=8, block_ids=(2,))
    x = torch.randn(8, 1, 4)
    s.begin_step([chunk])
    s.layers()[0].write(x, x)
    s.end_step()
    k, _ = s._layers[0].gather(torch.tensor([2]), 8)
    ref = s.pool.k.decode(s.pool.k.encode_blocks(x.view(1, 8, 1, 4)), torch.float32).view(8, 1, 4)
    assert torch.equal(k, ref)
