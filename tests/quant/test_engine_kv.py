"""Lossy KV through the whole engine, on a tiny random-weight Llama (fp32, block size 4).

Random weights attend almost uniformly, so these tests check mechanics (bytes, identity, policy,
mixing, leaks), not quality; the quality gate uses the trained model (test_quality_gate.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.engine.llm import LLM
from kvserve.kv.layout import kv_block_bytes, resolve_kv_dtype
from kvserve.sampling_params import SamplingParams
from tests.engine.conftest import write_tiny_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 13, 200, 17, 42, 7, 99, 3, 11, 60], [8, 8, 300, 12, 4, 77, 1000], [31, 41, 59, 26, 53, 58, 97, 93, 23]]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/quant/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-kvq"))


def make(tiny: Path, kv: str = "auto", **kw: object) -> LLM:
    kw.setdefault("kv_cache_memory", "2MiB")
    kw.setdefault("max_num_seqs", 4)
    return LLM(tiny, kv_cache_dtype=kv, block_size=4, num_threads=1, **kw)  # type: ignore[arg-type]


def tokens(llm: LLM, prompts: list[list[int]] = PROMPTS, **kw: object) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, **kw)  # type: ignore[arg-type]
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leaks(llm: LLM) -> None:
    eng = llm.engine
    eng.kv.check()
    eng.runner.storage.check()
    assert eng.kv.usage().used == 0
    assert eng.runner.kv_bytes == eng.capacity.allocated_bytes


@pytest.mark.parametrize("kv", ["int8", "fp8", "int4", "k:int8,v:int4"])
def test_engine_bytes_equal_storage_and_capacity_grows(tiny: Path, kv: str) -> None:
    ref = make(tiny, "auto")
    llm = make(tiny, kv)
    cap = llm.engine.capacity
    name = resolve_kv_dtype(kv)
    assert cap.bytes_per_token * 4 == kv_block_bytes(2, 2, 16, name, 4)
    assert llm.engine.runner.kv_bytes == cap.allocated_bytes <= cap.budget_bytes
    assert cap.token_capacity > 1.5 * ref.engine.capacity.token_capacity  # head_dim 16: scales weigh more
    if "int4" in kv:  # int4 keys or (default) int4 sinks: max_num_seqs × (unfinished group, previous, sink)
        assert cap.window_blocks == 4 * 3
    else:
        assert cap.window_blocks == 0
    # by hand: 2 layers × 2 KV heads × (K + V bytes per token and head), head_dim 16, blocks of 4
    # (int8/fp8: 16 + a 4-byte scale; int4 K: 8 + 4 × 16 / 4 group scales; int4 V: 8 + 4)
    hand = {"int8": 2 * 2 * (20 + 20), "fp8": 2 * 2 * (20 + 20), "int4": 2 * 2 * (24 + 12),
            "k:int8,v:int4": 2 * 2 * (20 + 12)}[kv]
    assert cap.bytes_per_token == hand
    assert ref.engine.capacity.bytes_per_token == 2 * 2 * 2 * 16 * 4  # the fp32 pool: 512
    summary = cap.summary()
    assert f"{cap.num_blocks} blocks × 4 tokens = {cap.num_blocks * 4} tokens, {hand} bytes/token" in summary
    assert ("full-precision window of" in summary) == (cap.window_blocks > 0)


def test_unknown_codec_is_rejected_with_the_valid_list(tiny: Path) -> None:
    with pytest.raises(ValueError, match=r"valid: auto, .*int4.*int8"):
        make(tiny, "int3")
    llm = make(tiny, "int8")
    with pytest.raises(ValueError, match="valid"):
        llm.engine.add_request({"prompt_token_ids": [1, 2, 3]}, GREEDY, kv_cache_dtype="nf4")
    with pytest.raises(ValueError, match="more bytes per block"):
        llm.engine.add_request({"prompt_token_ids": [1, 2, 3]}, GREEDY, kv_cache_dtype="fp32")
    with pytest.raises(ValueError, match="valid"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}], GREEDY, kv_cache_dtype="q4_0")
    assert not llm.engine.has_unfinished_requests()  # nothing was queued
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, kv_cache_dtype="fp8")[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def logprobs(llm: LLM) -> list[list[float]]:
    """The chosen token's log-probability at every step of every prompt (greedy)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [[lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]


def test_full_precision_below_the_threshold_equals_float_kv(tiny: Path) -> None:
    """kv_quant_min_tokens above every sequence: int8 storage, but every read is full precision,
    so the tokens and log-probabilities equal the float engine's exactly; from 0, int8 reads are
    used, which moves the log-probabilities."""
    float_kv = make(tiny, "auto")
    ref = tokens(float_kv)
    lazy = make(tiny, "int8", kv_quant_min_tokens=64)
    assert tokens(lazy) == ref
    ref_lp = logprobs(float_kv)
    assert logprobs(lazy) == ref_lp  # bit for bit: nothing was read in int8
    assert_no_leaks(lazy)
    eager = make(tiny, "int8")
    assert eager.engine.capacity.window_blocks == 0
    eager_lp = logprobs(eager)
    drift = max(abs(a - b) for xs, ys in zip(eager_lp, ref_lp) for a, b in zip(xs, ys))
    assert 1e-5 < drift < 0.5, drift  # int8 reads: close to float, but not equal
    assert_no_leaks(eager)


def test_mixed_codecs_in_one_batch_equal_their_own_engines(tiny: Path) -> None:
    """A float pool serving a default, an int8 and an fp8 request in the same steps: each request's
    tokens equal those of an engine whose whole pool uses its codec."""
    mixed = make(tiny, "auto")
    eng = mixed.engine
    ids = [eng.add_request({"prompt_token_ids": p}, GREEDY, kv_cache_dtype=kv)
           for p, kv in zip(PROMPTS, [None, "int8", "fp8"])]
    done = {o.request_id: o.outputs[0].token_ids for o in eng.run_until_done()}
    assert len(eng.runner.storage.pairs_used) == 3
    for rid, prompt, kv in zip(ids, PROMPTS, ["auto", "int8", "fp8"]):
        assert done[rid] == tokens(make(tiny, kv), [prompt])[0]
    assert_no_leaks(mixed)


def test_the_codec_is_part_of_prefix_identity(tiny: Path) -> None:
    llm = make(tiny, "auto")
    prompt = {"prompt_token_ids": list(range(40, 61))}
    first = llm.generate(prompt, GREEDY)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate(prompt, GREEDY)[0]
    assert second.num_cached_tokens == 20  # same codec: five full blocks hit
    eng = llm.engine
    rid = eng.add_request(prompt, GREEDY, kv_cache_dtype="int8")
    out = {o.request_id: o for o in eng.run_until_done()}[rid]
    assert out.num_cached_tokens == 0  # a float block is never read as int8 …
    rid = eng.add_request(prompt, GREEDY, kv_cache_dtype="int8")
    again = {o.request_id: o for o in eng.run_until_done()}[rid]
    assert again.num_cached_tokens == 20  # … but int8 blocks are, by int8 requests
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    rid = eng.add_request(prompt, GREEDY, kv_cache_dtype="auto")  # the engine's own codec, spelt out
    assert {o.request_id: o for o in eng.run_until_done()}[rid].num_cached_tokens == 20
    assert_no_leaks(llm)


@pytest.mark.parametrize("kv", ["int4", "int8"])
def test_prefix_hits_read_fully_encoded_blocks(tiny: Path, kv: str) -> None:
    """A hit reads blocks some other request finished: its tokens equal a run without caching
    (so full blocks held complete codec data, int4 key groups included)."""
    cached = make(tiny, kv, kv_quant_sink_tokens=2 if kv == "int4" else 0)
    long = [list(range(100, 123))]
    a = tokens(cached, long)
    uncached = make(tiny, kv, enable_prefix_caching=False, kv_quant_sink_tokens=2 if kv == "int4" else 0)
    hits_before = cached.engine.stats().prefix_hits
    b = tokens(cached, long)
    assert cached.engine.stats().prefix_hits - hits_before == 20  # the second run hit five full blocks
    assert b == a == tokens(uncached, long)  # the run that hit equals the run that computed everything
    assert_no_leaks(cached)


def test_sessions_forks_and_preemption_with_int4(tiny: Path) -> None:
    """The paths that move or copy blocks (sessions, n > 1 copy-on-write, preemption) under int4
    with sinks and a threshold: every request finishes, bookkeeping stays consistent, no leaks."""
    llm = make(tiny, "int4", kv_cache_memory="40KiB", kv_quant_min_tokens=8, kv_quant_sink_tokens=2,
               max_num_seqs=3, max_num_batched_tokens=16)
    for turn in range(3):
        out = llm.generate({"prompt_token_ids": [7 + turn, 8, 9, 10, 11]}, GREEDY, session_id="s")[0]
        assert len(out.outputs[0].token_ids) == 12
    llm.close_session("s")
    many = llm.generate([{"prompt_token_ids": p * 3} for p in PROMPTS],
                        SamplingParams(temperature=0.8, n=2, max_tokens=20, seed=1, ignore_eos=True))
    assert all(len(c.token_ids) == 20 for o in many for c in o.outputs)
    assert llm.engine.stats().num_preemptions > 0  # the pool was tight enough to preempt
    assert_no_leaks(llm)


def test_min_tokens_needs_room_for_its_window(tiny: Path) -> None:
    with pytest.raises(ValueError, match="window"):
        make(tiny, "int8", kv_cache_memory="64KiB", kv_quant_min_tokens=4096, max_num_seqs=64)
