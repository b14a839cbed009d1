"""Sampling, stopping, n > 1 and aborts through the whole engine."""

from __future__ import annotations

import json
import shutil

import pytest

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

PROMPT = {"prompt_token_ids": [11, 22, 33, 44, 55]}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", block_size=4)


def tokens(llm: LLM, **kw) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(ignore_eos=True, **kw))[0].outputs[0].token_ids


def test_same_seed_same_tokens_different_seed_differs(llm):
    a = tokens(llm, max_tokens=20, temperature=1.0, seed=123)
    b = tokens(llm, max_tokens=20, temperature=1.0, seed=123)
    c = tokens(llm, max_tokens=20, temperature=1.0, seed=124)
    assert a == b and a != c


def test_seeded_request_is_independent_of_its_batch(llm):
    alone = tokens(llm, max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    others = [{"prompt_token_ids": [i, i + 1, i + 2]} for i in range(3)]
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)]
    params += [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)] * 3
    outs = llm.generate([PROMPT, *others], params)
    assert outs[0].outputs[0].token_ids == alone


def test_top_k_one_is_greedy(llm):
    assert tokens(llm, max_tokens=10, temperature=1.5, top_k=1, seed=3) == tokens(llm, max_tokens=10, temperature=0)


def test_max_tokens_and_finish_reason(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"
    assert out.finished


def test_stop_token_ids_end_the_request(llm):
    ref = tokens(llm, max_tokens=8, temperature=0)
    stop_at = ref[3]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_at],
                                                ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref[:ref.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_stop_string_cuts_the_text(llm):
    full = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].outputs[0]
    text = full.text
    stop = next((text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip("greedy text too short to pick a stop string")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, stop=[stop],
                                                ignore_eos=True))[0].outputs[0]
    assert out.text == text[:text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 30


def test_eos_ends_unless_ignored(llm, tiny_llama, tmp_path):
    """The same weights with one of the model's own greedy tokens declared EOS (generation_config.json,
    which the engine reads): the request ends there, EOS included; with ignore_eos it runs on."""
    ref = tokens(llm, max_tokens=10, temperature=0)
    i = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])  # a token first seen at i >= 2
    model = tmp_path / "eos-model"
    shutil.copytree(tiny_llama, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [ref[i]]}))
    eos_llm = LLM(model, dtype="float32", kv_cache_memory="8MiB", block_size=4)
    assert ref[i] in eos_llm.engine._eos
    stopped = eos_llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
    assert stopped.token_ids == ref[:i + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = eos_llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert ignored.outputs[0].token_ids == ref and ignored.outputs[0].finish_reason == "length"
    eos_llm.engine.kv.check()
    assert eos_llm.engine.kv.usage().used == 0


def test_n_samples_share_the_prompt_blocks(llm):
    prompt = {"prompt_token_ids": list(range(200, 233))}  # 33 tokens: 8 full blocks of 4
    hits_before = llm.engine.kv.stats.hits
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different samples
    assert llm.engine.kv.stats.hits - hits_before == 2 * 32  # two siblings hit the leader's 8 blocks
    assert llm.engine.kv.usage().used == 0


def test_abort_returns_every_block(llm):
    engine = llm.engine
    rid = engine.add_request({"prompt_token_ids": list(range(40))}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv.usage().used > 0
    engine.abort_request(rid)
    outs = engine.step()
    assert any(o.request_id == rid and o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    engine.kv.check()
    assert engine.kv.usage().used == 0 and not engine.has_unfinished_requests()
    final = next(o for o in outs if o.request_id == rid)
    assert len(final.outputs[0].token_ids) < 50  # stopped early, not run to the end


def until_every_sample_decodes(engine, rid: str, n: int, steps: int = 200) -> None:
    """Step until all ``n`` samples of ``rid`` have a token (and so hold blocks)."""
    for _ in range(steps):
        for out in engine.step():
            if out.request_id == rid and len(out.outputs) == n and all(c.token_ids for c in out.outputs):
                return
    pytest.fail(f"the {n} samples of {rid} never all decoded")


def test_abort_of_n_samples_stops_every_sample_and_returns_every_block(llm):
    engine = llm.engine
    rid = engine.add_request({"prompt_token_ids": list(range(300, 322))},
                             SamplingParams(n=3, max_tokens=60, temperature=1.0, seed=2, ignore_eos=True))
    until_every_sample_decodes(engine, rid, 3)
    assert engine.scheduler.num_running == 3 and engine.kv.usage().used > 0
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    engine.kv.check()
    assert engine.kv.usage().used == 0
    final = [o for o in engine.step() if o.request_id == rid]
    assert len(final) == 1 and final[0].finished
    assert [c.finish_reason for c in final[0].outputs] == ["abort"] * 3
    assert all(len(c.token_ids) < 60 for c in final[0].outputs)
    assert engine.step() == []  # nothing left running or to report


def test_abort_of_a_queued_request_and_of_a_queued_session_turn(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", block_size=4, max_num_seqs=1)
    engine = llm.engine
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": [3, 4, 5, 6, 7]}, greedy, session_id="s")[0]
    running = engine.add_request({"prompt_token_ids": list(range(50, 60))},
                                 SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    queued = engine.add_request({"prompt_token_ids": [8, 9]}, greedy)
    turn = engine.add_request({"prompt_token_ids": [10, 11]}, greedy, session_id="s")
    engine.step()
    assert engine.scheduler.num_running == 1 and engine.scheduler.num_waiting == 2
    engine.abort_request(queued)
    engine.abort_request(turn)
    assert engine.scheduler.num_waiting == 0
    engine.kv.check()
    session = engine.kv.sessions.get("s")
    assert not session.busy and session.token_ids == first.prompt_token_ids + first.outputs[0].token_ids
    done = {o.request_id: o for o in engine.run_until_done()}
    assert done[queued].outputs[0].finish_reason == "abort" and done[queued].outputs[0].token_ids == []
    assert done[turn].outputs[0].finish_reason == "abort"
    assert done[running].outputs[0].finish_reason == "length" and len(done[running].outputs[0].token_ids) == 20
    # the session is free again: its next turn runs and reuses its KV
    history = list(session.token_ids)
    nxt = llm.generate({"prompt_token_ids": [12]}, greedy, session_id="s")[0]
    assert nxt.prompt_token_ids == history + [12] and nxt.num_cached_tokens == len(history) - 1
    assert llm.close_session("s")
    engine.kv.check()
    assert engine.kv.usage().used == 0


def test_reset_prefix_cache_makes_the_next_identical_prompt_recompute(llm):
    prompt = {"prompt_token_ids": list(range(400, 413))}  # 13 tokens: three full blocks of 4
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = llm.generate(prompt, greedy)[0]
    second = llm.generate(prompt, greedy)[0]
    assert second.num_cached_tokens == 12 and second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.kv.reset_prefix_cache() >= 3
    assert llm.engine.kv.usage().cached_free == 0
    third = llm.generate(prompt, greedy)[0]
    assert third.num_cached_tokens == 0 and third.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_prompt_of_whole_blocks_is_hit_whole(llm):
    """16 prompt tokens fill four blocks: all four are cached once computed, and a longer prompt
    starting with them reuses all 16 tokens."""
    base = list(range(500, 516))
    llm.generate({"prompt_token_ids": base}, SamplingParams(max_tokens=1, temperature=0))
    out = llm.generate({"prompt_token_ids": base + [7, 8, 9]}, SamplingParams(max_tokens=2, temperature=0))[0]
    assert out.num_cached_tokens == 16


def test_unchunked_prefill_rejects_a_prompt_over_the_batch_budget_and_never_spins(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", block_size=4,
              enable_chunked_prefill=False, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match=r"prompt \(40 tokens\).*max_num_batched_tokens \(32\)"):
        llm.generate({"prompt_token_ids": list(range(40))}, SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": list(range(24))}, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8


def test_text_prompt_and_chat(llm):
    out = llm.generate("def add(a, b):", SamplingParams(max_tokens=5, temperature=0))[0]
    assert out.prompt == "def add(a, b):" and out.prompt_token_ids
    assert out.prompt_token_ids == list(llm.tokenizer.encode("def add(a, b):", add_special_tokens=True))
    messages = [{"role": "user", "content": "hello"}]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    chat = llm.chat(messages, greedy)[0]
    assert chat.prompt_token_ids == llm.chat_token_ids(messages)
    text = llm.tokenizer.decode(chat.prompt_token_ids, skip_special_tokens=False)
    assert "hello" in text and text != "hello"  # the chat template wrapped the message
    same = llm.generate({"prompt_token_ids": chat.prompt_token_ids}, greedy)[0]
    assert chat.outputs[0].token_ids == same.outputs[0].token_ids and len(same.outputs[0].token_ids) == 4
