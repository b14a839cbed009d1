"""The OpenAI endpoints through the official ``openai`` client against a live server."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.server.conftest import BLOCK_SIZE, MODEL_NAME, held_blocks, wait_until

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def unique_ids(seed: int, n: int) -> list[int]:
    """Token ids no other test sends (so the prefix cache cannot already hold them)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(n)]


def test_models_lists_the_served_name(client, live):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    raw = httpx.get(live.v1 + "/models").json()
    assert raw["data"][0]["max_model_len"] == 256
    assert raw["data"][0]["kv_cache_dtype"] in ("bfloat16", "float32", "float16")  # the engine's KV codec


def test_completion_stream_equals_non_stream(client):
    kw = {"model": MODEL_NAME, "prompt": "The cache", "max_tokens": 10, "temperature": 0}
    full = client.completions.create(**kw)
    assert full.usage.completion_tokens == 10 and full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_several_prompts_and_n_number_choices_like_openai(client):
    p1, p2 = unique_ids(1, 5), unique_ids(2, 7)
    out = client.completions.create(model=MODEL_NAME, prompt=[p1, p2], n=2, max_tokens=3, temperature=0.8, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 12  # each prompt counted once, not once per sample
    assert out.usage.completion_tokens == 12


def test_chat_stream_with_usage(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == full.usage.total_tokens
    # the streamed request resent the same prompt: every full block but the one holding its last token hit
    hit = (full.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == hit > 0


def test_seed_makes_sampling_reproducible_and_n_gives_samples(client):
    kw = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "pick"}], "max_tokens": 6, "n": 3,
          "temperature": 1.0, "seed": 1234}
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts_a = [c.message.content for c in sorted(a.choices, key=lambda c: c.index)]
    texts_b = [c.message.content for c in sorted(b.choices, key=lambda c: c.index)]
    assert texts_a == texts_b
    assert len(set(texts_a)) > 1  # three samples, not one answer three times
    assert a.usage.completion_tokens == 18


def test_stop_string_cuts_text_also_when_streaming(client):
    base = {"model": MODEL_NAME, "prompt": unique_ids(3, 6), "max_tokens": 16, "temperature": 0}
    text = client.completions.create(**base).choices[0].text
    assert len(text) >= 8, text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text[:text.find(stop)]
    out = client.completions.create(**base, stop=[stop])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**base, stop=stop, stream=True)
                       if c.choices)
    assert streamed == cut  # nothing of the stop string leaked before it was recognised


def test_cached_tokens_reported_for_a_repeated_prompt(client):
    prompt = unique_ids(4, 21)
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (21 - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_logprobs_in_both_shapes(client):
    out = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and chosen == pytest.approx(max(top.values()))  # greedy picks the top token
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def _turn(client, sid, messages, via_header=False, max_tokens=5):
    extra = {"headers": {"X-Session-Id": sid}} if via_header else {"body": {"session_id": sid}}
    return client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0,
        extra_body={"return_token_ids": True, **extra.get("body", {})}, extra_headers=extra.get("headers"))


def test_session_appends_only_new_tokens_and_reuses_kv(client, live):
    first = _turn(client, "conv-a", [{"role": "user", "content": "Tell me about caches."}])
    p1, g1 = first.prompt_token_ids, first.choices[0].token_ids
    listed = {s["id"]: s for s in httpx.get(live.v1 + "/sessions").json()["data"]}
    assert listed["conv-a"]["num_tokens"] == len(p1) + len(g1)
    assert listed["conv-a"]["pinned_blocks"] > 0
    second = _turn(client, "conv-a", [{"role": "user", "content": "And then?"}], via_header=True)
    p2 = second.prompt_token_ids
    assert p2[:len(p1) + len(g1)] == p1 + g1  # history appended as tokens, never re-tokenized
    assert second.usage.prompt_tokens == len(p2)
    assert second.usage.prompt_tokens_details.cached_tokens == len(p1) + len(g1) - 1
    # the same tokens without a session give the same greedy answer
    plain = client.completions.create(model=MODEL_NAME, prompt=p2, max_tokens=5, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert plain.choices[0].token_ids == second.choices[0].token_ids
    assert httpx.delete(live.v1 + "/sessions/conv-a").json()["deleted"] is True
    assert httpx.delete(live.v1 + "/sessions/conv-a").status_code == 404
    assert "conv-a" not in {s["id"] for s in httpx.get(live.v1 + "/sessions").json()["data"]}
    wait_until(lambda: held_blocks(live) == 0, what="blocks back")


def test_session_accepts_new_messages_or_the_whole_conversation(client, live):
    user1 = {"role": "user", "content": "hi there"}
    r_x = _turn(client, "conv-x", [user1])
    r_y = _turn(client, "conv-y", [user1])
    reply = {"role": "assistant", "content": r_y.choices[0].message.content}
    new = {"role": "user", "content": "go on"}
    t_x = _turn(client, "conv-x", [new])                  # only the new message
    t_y = _turn(client, "conv-y", [user1, reply, new])    # the whole conversation again
    assert r_x.choices[0].token_ids == r_y.choices[0].token_ids
    assert t_x.prompt_token_ids == t_y.prompt_token_ids
    assert t_x.choices[0].token_ids == t_y.choices[0].token_ids
    for sid in ("conv-x", "conv-y"):
        assert httpx.delete(f"{live.v1}/sessions/{sid}").status_code == 200


def test_session_turns_are_one_at_a_time(live):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "long"}], "max_tokens": 200,
            "ignore_eos": True, "stream": True, "session_id": "conv-busy"}
    with httpx.stream("POST", live.v1 + "/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        second = httpx.post(live.v1 + "/chat/completions", json={**body, "stream": False}, timeout=30)
        assert second.status_code == 409 and second.json()["error"]["code"] == "session_busy"
    wait_until(lambda: not any(s["busy"] for s in httpx.get(live.v1 + "/sessions").json()["data"]),
               what="the aborted turn to end")
    assert httpx.delete(live.v1 + "/sessions/conv-busy").status_code == 200


def test_session_with_n_above_one_is_refused(live):
    r = httpx.post(live.v1 + "/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 2,
                                                         "session_id": "conv-n"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_streaming_n_samples_match_the_non_streaming_answer(client):
    kw = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "two ways"}], "max_tokens": 5, "n": 2,
          "temperature": 1.0, "seed": 99}
    full = client.chat.completions.create(**kw)
    texts = {0: "", 1: ""}
    roles, finishes = set(), []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            roles |= {ch.index} if ch.delta.role == "assistant" else set()
            finishes += [ch.index] if ch.finish_reason else []
    assert texts == {c.index: c.message.content for c in full.choices}
    assert roles == {0, 1} and sorted(finishes) == [0, 1]


def test_completions_continue_a_session_as_tokens(client, live):
    kw = {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0}
    first = client.completions.create(**kw, prompt="Once upon", extra_headers={"X-Session-Id": "cmpl-s"},
                                      extra_body={"return_token_ids": True})
    second = client.completions.create(**kw, prompt=" a time", extra_headers={"X-Session-Id": "cmpl-s"},
                                       extra_body={"return_token_ids": True})
    hist = first.choices[0].prompt_token_ids + first.choices[0].token_ids
    assert second.choices[0].prompt_token_ids[:len(hist)] == hist
    assert second.usage.prompt_tokens_details.cached_tokens == len(hist) - 1
    assert httpx.delete(live.v1 + "/sessions/cmpl-s").status_code == 200
