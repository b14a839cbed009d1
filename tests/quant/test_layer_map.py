"""Per-layer KV codec maps (``layers:…``): names, bytes, the engine path against a reference that
quantizes the same layers, block export/import, and the prefix-cache identity.

Tiny random-weight Llama (fp32, 3 layers, block size 4): mechanics and exactness, not quality.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.engine.llm import LLM
from kvserve.eval.kv_quality import teacher_forced_logprobs
from kvserve.kv.block_io import export_block, import_block
from kvserve.kv.codec_names import KVCodecSpec, map_name, parse_layer_codecs, resolve_kv_dtype
from kvserve.kv.layer_kv import PlainLayerKV
from kvserve.kv.layout import kv_block_bytes, window_blocks
from kvserve.kv.quant import make_codec, round_trip
from kvserve.kv.storage import KVStorage
from kvserve.sampling_params import SamplingParams
from tests.engine.conftest import write_tiny_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 9, 13, 200, 17, 42, 7, 99, 3, 11, 60], [8, 8, 300, 12, 4, 77, 1000, 31, 41]]
MIXED = "layers:int8/bfloat16/k:fp8,v:int8"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/quant/conftest.py


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-map"), num_hidden_layers=3)


def make(path: Path, kv: str = "auto", **kw: object) -> LLM:
    kw.setdefault("kv_cache_memory", "2MiB")
    kw.setdefault("max_num_seqs", 4)
    return LLM(path, kv_cache_dtype=kv, block_size=4, num_threads=1, **kw)  # type: ignore[arg-type]


def tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def test_map_names_parse_round_trip_and_collapse() -> None:
    pairs = parse_layer_codecs("layers:int8*2/k:int8,v:int4/bf16", num_layers=4)
    assert pairs == (KVCodecSpec("int8", "int8"),) * 2 + (KVCodecSpec("int8", "int4"), KVCodecSpec("bfloat16", "bfloat16"))
    assert map_name(pairs) == "layers:int8*2/k:int8,v:int4/bfloat16"
    assert parse_layer_codecs(map_name(pairs), num_layers=4) == pairs
    assert resolve_kv_dtype("layers:bf16*2/bfloat16") == "bfloat16"  # all layers agree: the one name
    assert parse_layer_codecs("int8", num_layers=2) == (KVCodecSpec("int8", "int8"),) * 2
    for bad, why in (("layers:int8*0", "a run is"), ("layers:int3", "unknown KV dtype"),
                     ("layers:", "cannot read KV map"), ("layers:int8/", "cannot read KV map")):
        with pytest.raises(ValueError, match=why):
            parse_layer_codecs(bad)
    with pytest.raises(ValueError, match="names 2 layers but the model has 3"):
        parse_layer_codecs("layers:int8/int4", num_layers=3)


def test_block_bytes_are_the_sum_over_layers() -> None:
    one = {n: kv_block_bytes(1, 2, 16, n, 4) for n in ("int8", "bfloat16", "k:fp8,v:int8", "int4")}
    assert kv_block_bytes(3, 2, 16, MIXED, 4) == one["int8"] + one["bfloat16"] + one["k:fp8,v:int8"]
    assert kv_block_bytes(2, 2, 16, "layers:int4/bfloat16", 4) == one["int4"] + one["bfloat16"]
    assert window_blocks(MIXED, 4, 4, 0, 4) == 0                      # no int4 layer: no window
    assert window_blocks("layers:int4/bfloat16", 4, 4, 0, 4) == 4 * 3  # one int4 layer: the int4 window


def test_all_full_precision_map_is_todays_path(tiny3: Path) -> None:
    ref, same = make(tiny3, "bf16"), make(tiny3, "layers:bfloat16*3")
    assert same.engine.kv_dtype == "bfloat16" and same.engine.kv.root_key == ref.engine.kv.root_key
    assert same.engine.capacity == ref.engine.capacity
    assert tokens(same) == tokens(ref)
    assert make(tiny3, "layers:float32*3").engine.kv_dtype == "float32"


class FakeQuantLayer:
    """The reference: a float pool layer that stores K/V after an encode→decode round trip."""

    def __init__(self, plain: PlainLayerKV, k: str, v: str) -> None:
        self.plain, self.k, self.v = plain, make_codec(k, "k", 4), make_codec(v, "v", 4)
        self.shape, self.dtype = plain.shape, plain.dtype

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.plain.write(round_trip(self.k, k[None])[0], round_trip(self.v, v[None])[0], slot_mapping)

    def gather_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        return self.plain.gather_blocks(block_ids)


def test_mixed_map_equals_a_reference_quantizing_the_same_layers(tiny3: Path) -> None:
    mixed = make(tiny3, MIXED, enable_prefix_caching=False)
    ref = make(tiny3, "auto", enable_prefix_caching=False)
    full = make(tiny3, "auto", enable_prefix_caching=False)
    storage = ref.engine.runner.storage
    pairs = parse_layer_codecs(MIXED, num_layers=3)
    fake = [FakeQuantLayer(layer, p.k, p.v) for layer, p in zip(storage._plain_layers, pairs)]
    storage.layers = lambda: fake  # type: ignore[method-assign]
    seqs = [list(range(7, 7 + 37)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]]
    got = teacher_forced_logprobs(mixed.engine, seqs, chunk=5)
    want = teacher_forced_logprobs(ref.engine, seqs, chunk=5)
    exact = teacher_forced_logprobs(full.engine, seqs, chunk=5)
    for g, w, e in zip(got, want, exact):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)
        assert float((g - e).abs().max()) > 1e-4  # the map does quantize
    assert mixed.engine.runner.kv_bytes == mixed.engine.capacity.allocated_bytes
    assert mixed.engine.capacity.bytes_per_token * 4 == kv_block_bytes(3, 2, 16, MIXED, 4)


def test_mixed_map_with_int4_serves_overrides_and_leaks_nothing(tiny3: Path) -> None:
    llm = make(tiny3, "layers:int4/int8/float32")
    eng = llm.engine
    assert eng.capacity.window_blocks == 4 * 3
    out = tokens(llm)
    assert all(len(t) == GREEDY.max_tokens for t in out)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, kv_cache_dtype="k:int8,v:int4")  # fits every layer
    with pytest.raises(ValueError, match="needs more bytes per block"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, kv_cache_dtype="float32")
    eng.kv.check()
    eng.runner.storage.check()
    assert eng.kv.usage().used == 0
    assert eng.runner.kv_bytes == eng.capacity.allocated_bytes


def test_the_map_is_part_of_the_prefix_cache_identity(tiny3: Path) -> None:
    roots = {make(tiny3, kv).engine.kv.root_key for kv in
             ("auto", "int8", MIXED, "layers:int8/int8/bfloat16", "layers:bfloat16/int8/int8")}
    assert len(roots) == 5


def storage(kv: str, layers: int = 3, blocks: int = 6) -> KVStorage:
    return KVStorage(num_layers=layers, num_blocks=blocks, block_size=4, kv_heads=2, head_dim=16, dtype=torch.float32,
                     pool=parse_layer_codecs(kv, "float32", layers), group_size=4,
                     window_blocks=window_blocks(kv, 4, 2, 0, 0), sink_tokens=0)


class _Chunk:
    def __init__(self, start: int, end: int, block_ids: list[int]) -> None:
        self.start, self.end, self.block_ids = start, end, block_ids


def test_block_export_import_round_trips_per_layer_regions() -> None:
    kv = "layers:int4/k:int8,v:int4/float32"
    s = storage(kv)
    assert s.nbytes == 6 * kv_block_bytes(3, 2, 16, kv, 4) + s.window_nbytes
    assert [r.shape[1] for r in s.k_regions] != [s.k_regions[0].shape[1]] * 3  # each layer its own bytes
    torch.manual_seed(0)
    s.begin_step([_Chunk(0, 8, [0, 1])])
    for layer in s.layers():
        k, v = torch.randn(2, 8, 2, 16)
        layer.write(k, v, torch.arange(8))
    s.end_step()
    before = [layer.gather_blocks(torch.tensor([1])) for layer in s.layers()]
    payload = export_block(s, 1)
    assert payload.codec == resolve_kv_dtype(kv)
    other = storage(kv)
    import_block(other, payload, 4)
    after = [layer.gather_blocks(torch.tensor([4])) for layer in other.layers()]
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="per-layer map"):
        import_block(storage("layers:int8/int8/float32"), payload, 0)


def test_a_mixed_map_round_trips_through_the_disk_tier_and_other_maps_never_load_it(tiny3: Path,
                                                                                    tmp_path: Path) -> None:
    kv, other = "layers:int8/k:int8,v:int4/float32", "layers:int8/int8/float32"
    prompt = {"prompt_token_ids": list(range(100, 160))}  # 15 blocks of 4

    def run(llm: LLM) -> tuple[list[int], dict[str, int]]:
        out = llm.generate(prompt, GREEDY)[0]
        llm.engine.kv.check()
        return out.outputs[0].token_ids, out.kv_hit_tokens

    reference = run(make(tiny3, kv, num_blocks=24, kv_cache_memory=None))[0]
    first = make(tiny3, kv, num_blocks=24, kv_cache_memory=None, kv_disk_dir=tmp_path)
    run(first)
    del first
    second = make(tiny3, kv, num_blocks=24, kv_cache_memory=None, kv_disk_dir=tmp_path)
    tokens, hits = run(second)
    assert tokens == reference and hits.get("disk", 0) >= 14 * 4 - 4
    stranger = make(tiny3, other, num_blocks=24, kv_cache_memory=None, kv_disk_dir=tmp_path)
    assert run(stranger)[1].get("disk", 0) == 0
