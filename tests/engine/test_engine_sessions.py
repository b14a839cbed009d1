"""Sessions through the engine: continuing a conversation equals sending the whole history."""

from __future__ import annotations

import pytest

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
TURNS = [[5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38], [40]]


@pytest.fixture()
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", block_size=4)


def test_session_turns_equal_whole_history_and_reuse_it(tiny_llama, llm):
    reference = LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", block_size=4,
                    enable_prefix_caching=False)
    history: list[int] = []
    for i, new in enumerate(TURNS):
        out = llm.generate({"prompt_token_ids": new}, GREEDY, session_id="conv")[0]
        whole = reference.generate({"prompt_token_ids": history + new}, GREEDY)[0]
        assert out.prompt_token_ids == history + new
        assert out.outputs[0].token_ids == whole.outputs[0].token_ids
        if i > 0:  # everything but the last generated token of the previous turn came from the session
            assert out.num_cached_tokens == len(history) - 1
        history = out.prompt_token_ids + out.outputs[0].token_ids
        llm.engine.kv.check()
    session = llm.engine.kv.sessions.get("conv")
    assert session.token_ids == history and session.resident
    assert llm.close_session("conv")
    llm.engine.kv.check()
    assert llm.engine.kv.usage().used == 0


def test_chat_session_appends_only_new_messages(llm):
    out1 = llm.chat([{"role": "user", "content": "def add(a, b):"}], GREEDY, session_id="c")[0]
    out2 = llm.chat([{"role": "user", "content": "and subtract?"}], GREEDY, session_id="c")[0]
    first_len = len(out1.prompt_token_ids) + len(out1.outputs[0].token_ids)
    assert out2.prompt_token_ids[:first_len] == out1.prompt_token_ids + out1.outputs[0].token_ids
    assert out2.num_cached_tokens == first_len - 1
    text = llm.tokenizer.decode(out2.prompt_token_ids[first_len:], skip_special_tokens=False)
    assert "and subtract?" in text and "add(a, b)" not in text


def test_max_session_tokens_error_and_drop_oldest(tiny_llama):
    strict = LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", block_size=4, max_session_tokens=30)
    strict.generate({"prompt_token_ids": list(range(1, 11))}, GREEDY, session_id="s")  # 16 tokens
    with pytest.raises(ValueError, match="max_session_tokens"):
        strict.generate({"prompt_token_ids": list(range(1, 11))}, GREEDY, session_id="s")
    session = strict.engine.kv.sessions.get("s")
    assert not session.busy and len(session.token_ids) == 16  # the rejected turn left no trace

    dropping = LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", block_size=4, max_session_tokens=40,
                   session_overflow="drop_oldest")
    first = dropping.generate({"prompt_token_ids": list(range(1, 11))}, GREEDY, session_id="s")[0]
    second = dropping.generate({"prompt_token_ids": list(range(11, 21))}, GREEDY, session_id="s")[0]
    assert len(second.prompt_token_ids) == 26  # 16 + 10 fits under 40 - 6
    third = dropping.generate({"prompt_token_ids": list(range(21, 31))}, GREEDY, session_id="s")[0]
    # 32 + 10 + 6 > 40: the oldest turn (16 tokens) is dropped, the second kept
    kept = second.prompt_token_ids[16:] + second.outputs[0].token_ids
    assert third.prompt_token_ids == kept + list(range(21, 31))
    assert first.outputs[0].token_ids  # sanity
    dropping.engine.kv.check()


def test_session_busy_and_n_rejected(llm):
    llm.engine.add_request({"prompt_token_ids": [1, 2, 3]}, GREEDY, session_id="b")
    with pytest.raises(ValueError, match="already serving a turn"):
        llm.engine.add_request({"prompt_token_ids": [4]}, GREEDY, session_id="b")
    with pytest.raises(ValueError, match="n > 1"):
        llm.engine.add_request({"prompt_token_ids": [4]}, SamplingParams(n=2), session_id="x")
    llm.engine.run_until_done()
    assert not llm.engine.kv.sessions.get("b").busy


def test_aborted_turn_leaves_history_unchanged(llm):
    llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, session_id="a")
    before = list(llm.engine.kv.sessions.get("a").token_ids)
    rid = llm.engine.add_request({"prompt_token_ids": [9, 9]}, GREEDY, session_id="a")
    llm.engine.step()
    llm.engine.abort_request(rid)
    llm.engine.step()
    session = llm.engine.kv.sessions.get("a")
    assert session.token_ids == before and not session.busy
    llm.engine.kv.check()


def test_continuing_a_session_under_another_salt_reuses_none_of_its_kv(llm):
    first = llm.generate({"prompt_token_ids": TURNS[0]}, GREEDY, session_id="salted", cache_salt="tenant-a")[0]
    history = a_history = first.prompt_token_ids + first.outputs[0].token_ids
    other = llm.generate({"prompt_token_ids": TURNS[1]}, GREEDY, session_id="salted", cache_salt="tenant-b")[0]
    assert other.prompt_token_ids == history + TURNS[1]
    assert other.num_cached_tokens == 0  # neither the session's blocks nor tenant a's prefix cache
    llm.engine.kv.check()
    history = other.prompt_token_ids + other.outputs[0].token_ids
    same = llm.generate({"prompt_token_ids": TURNS[2]}, GREEDY, session_id="salted", cache_salt="tenant-b")[0]
    assert same.num_cached_tokens == len(history) - 1  # tenant b's own previous turn is reused
    back = llm.generate({"prompt_token_ids": TURNS[3]}, GREEDY, session_id="salted", cache_salt="tenant-a")[0]
    # only tenant a's full blocks of its first turn (its computed tokens), from its own salted prefix cache
    assert back.num_cached_tokens == (len(a_history) - 1) // 4 * 4 == 8
    assert llm.close_session("salted")
    llm.engine.kv.check()
    assert llm.engine.kv.usage().used == 0
