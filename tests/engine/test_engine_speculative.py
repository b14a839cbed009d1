"""Speculative decoding (n-gram drafts) through the engine on the tiny random-weight model:
the tokens are the same with and without it — batched, with prefix-cache hits, across session
turns, greedy and seeded sampling — and the pool is whole afterwards."""

from __future__ import annotations

import pytest

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

REPEAT = [list(range(100, 112)) * 3, [7, 8, 9, 10] * 6 + [11], [300 + i % 5 for i in range(25)]]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def make(tiny_llama, **kw) -> LLM:
    return LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", block_size=4, **kw)


@pytest.fixture(scope="module")
def plain(tiny_llama) -> LLM:
    return make(tiny_llama)


@pytest.fixture(scope="module")
def spec(tiny_llama) -> LLM:
    return make(tiny_llama, speculative="ngram", num_speculative_tokens=4)


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def whole(llm: LLM) -> None:
    llm.engine.kv.check()
    assert llm.engine.kv.usage().used == llm.engine.kv.num_pinned_blocks()


def test_greedy_batch_is_identical_and_drafts_were_verified(plain, spec):
    before = spec.engine.stats()
    assert tokens(spec, REPEAT, GREEDY) == tokens(plain, REPEAT, GREEDY)
    after = spec.engine.stats()
    assert after.spec_verifies > before.spec_verifies
    assert after.spec_draft_tokens > before.spec_draft_tokens >= 0
    # this model and these prompts accept some drafts and reject others: both paths ran
    assert 0 < after.spec_accepted_tokens - before.spec_accepted_tokens < after.spec_draft_tokens - before.spec_draft_tokens
    whole(spec)


def test_prefix_hits_after_drafting_give_the_same_tokens(plain, spec):
    first = spec.generate({"prompt_token_ids": REPEAT[0]}, GREEDY)[0]
    follow = first.prompt_token_ids + first.outputs[0].token_ids + [5, 6, 7]
    again = spec.generate({"prompt_token_ids": follow}, GREEDY)[0]
    assert again.num_cached_tokens > len(REPEAT[0])  # generated (accepted) blocks were hit
    assert again.outputs[0].token_ids == tokens(plain, [follow], GREEDY)[0]
    whole(spec)


def test_seeded_sampling_is_identical(plain, spec):
    params = SamplingParams(max_tokens=20, temperature=0.7, top_k=8, seed=11, ignore_eos=True)
    assert tokens(spec, REPEAT, params) == tokens(plain, REPEAT, params)
    whole(spec)


def test_session_turns_are_identical_and_the_history_is_drafted_from(tiny_llama):
    ref, drafted = make(tiny_llama), make(tiny_llama, speculative="ngram")
    turns = [REPEAT[0], [1, 2, 3], REPEAT[1], [4]]
    for turn in turns:
        a = ref.generate({"prompt_token_ids": turn}, GREEDY, session_id="s")[0]
        b = drafted.generate({"prompt_token_ids": turn}, GREEDY, session_id="s")[0]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.num_cached_tokens == a.num_cached_tokens
        whole(drafted)
    assert drafted.engine.kv.sessions.get("s").token_ids == ref.engine.kv.sessions.get("s").token_ids
    assert drafted.engine.stats().spec_draft_tokens > 0


def test_eos_inside_accepted_drafts_ends_where_plain_decoding_ends(plain, spec):
    """Stopping tokens inside a verify's accepted tokens: the request ends at the first one."""
    out = tokens(plain, [REPEAT[0]], GREEDY)[0]
    stop = out[10]
    params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop,))
    assert tokens(spec, [REPEAT[0]], params) == tokens(plain, [REPEAT[0]], params)
    whole(spec)


def test_lossy_kv_codec_turns_drafting_off(tiny_llama):
    llm = make(tiny_llama, speculative="ngram", kv_cache_dtype="int8")
    assert llm.engine.scheduler.drafter is None


def test_a_stop_string_inside_accepted_drafts_ends_where_plain_decoding_ends(plain, spec):
    """The text is cut at the stop string, and so are the tokens: none of the accepted drafts
    after the token that completed it are returned. The stop
    strings span a repeated run (what drafts are accepted in), first completed at token k."""
    tok = plain.engine.tokenizer
    prompt = REPEAT[1]
    full = plain.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    checked = 0
    for k in range(4, len(full) - 2):
        stop = tok.decode(full[k - 4:k])
        if stop in tok.decode(full[:k - 1]) or not stop.strip():
            continue  # it would end both runs earlier: not this case
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
        a = plain.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
        b = spec.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), stop
        checked += 1
        whole(spec)
    assert checked >= 3
