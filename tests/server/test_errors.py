"""Bad input and limits: OpenAI error bodies, status codes, and no blocks lost on disconnect."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, held_blocks, wait_until

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err["message"]


def test_malformed_json(live):
    for body in (b"{not json", b"", b"[1, 2"):
        r = httpx.post(live.v1 + "/chat/completions", content=body, headers={"content-type": "application/json"})
        assert "malformed JSON" in assert_error(r, 400, code="invalid_json")


@pytest.mark.parametrize("field, value", [
    ("n", "2"), ("temperature", "hot"), ("max_tokens", 1.5), ("stream", "yes"), ("messages", "hi"),
    ("stop", 3), ("seed", 1.5),
])
def test_wrong_types_are_400_naming_the_field(live, field, value):
    r = httpx.post(live.v1 + "/chat/completions", json={**CHAT, field: value})
    msg = assert_error(r, 400)
    assert r.json()["error"]["param"].split(".")[0] == field, msg


def test_empty_messages_and_empty_prompt(live):
    assert_error(httpx.post(live.v1 + "/chat/completions", json={**CHAT, "messages": []}), 400, param="messages")
    assert_error(httpx.post(live.v1 + "/completions", json={"prompt": [], "max_tokens": 2}), 400, param="prompt")
    assert "empty" in assert_error(httpx.post(live.v1 + "/completions", json={"prompt": ""}), 400)


def test_prompt_plus_max_tokens_over_max_model_len_names_both(live):
    r = httpx.post(live.v1 + "/completions", json={"prompt": list(range(3, 103)), "max_tokens": 200})
    msg = assert_error(r, 400, param="max_tokens")
    assert "100 tokens" in msg and "max_tokens (200)" in msg and "max_model_len (256)" in msg
    long_chat = {"messages": [{"role": "user", "content": "word " * 400}]}
    assert "max_model_len (256)" in assert_error(httpx.post(live.v1 + "/chat/completions", json=long_chat), 400)
    assert held_blocks(live) == 0


def test_sampling_values_out_of_range(live):
    assert "temperature" in assert_error(httpx.post(live.v1 + "/chat/completions", json={**CHAT, "temperature": -1}),
                                         400, param="temperature")
    assert_error(httpx.post(live.v1 + "/chat/completions", json={**CHAT, "max_tokens": 0}), 400, param="max_tokens")


def test_unsupported_features_are_refused_not_ignored(live):
    for extra, param in (({"presence_penalty": 0.5}, "presence_penalty"), ({"tools": [{"type": "function"}]}, "tools"),
                         ({"logit_bias": {"5": 1.0}}, "logit_bias")):
        assert_error(httpx.post(live.v1 + "/chat/completions", json={**CHAT, **extra}), 400, param=param)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert exc.value.body["code"] == "model_not_found"


def test_unknown_route_and_method_use_the_error_shape(live):
    assert_error(httpx.get(live.v1 + "/nothing-here"), 404)
    assert_error(httpx.get(live.v1 + "/chat/completions"), 405)
    assert_error(httpx.delete(live.v1 + "/sessions/never-made"), 404, code="session_not_found")


def test_api_key(strict):
    body = {**CHAT, "max_tokens": 1}
    assert_error(httpx.post(strict.v1 + "/chat/completions", json=body), 401, code="missing_api_key")
    bad = openai.OpenAI(base_url=strict.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=strict.v1, api_key="sekret", max_retries=0)
    assert good.chat.completions.create(**body).usage.completion_tokens == 1
    assert httpx.get(strict.url + "/health").status_code == 200  # open: no prompts or outputs there
    assert httpx.get(strict.url + "/metrics").status_code == 200


def test_full_waiting_queue_is_429_with_retry_after(strict):
    auth = {"Authorization": "Bearer sekret"}
    long = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", strict.v1 + "/completions", json=long, headers=auth, timeout=30) as running:
        lines = running.iter_lines()  # keep a reference: a dropped iterator closes the connection
        next(lines)  # the first token: it runs (max_num_seqs=1)
        with httpx.stream("POST", strict.v1 + "/completions", json=long, headers=auth, timeout=30) as waiting:
            assert waiting.status_code == 200
            wait_until(lambda: strict.engine.num_waiting == 1, what="one waiting request")
            r = httpx.post(strict.v1 + "/completions", json={**long, "stream": False}, headers=auth)
            assert "waiting queue is full" in assert_error(r, 429, code="queue_full")
            assert r.headers["retry-after"] == "1"
    wait_until(lambda: held_blocks(strict) == 0 and strict.engine.num_waiting == 0, what="both aborted")


def _abort_count(live) -> float:
    return live.metrics().get(("kvserve:request_success_total", (("finish_reason", "abort"),)), 0.0)


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(live):
    before = _abort_count(live)
    body = {"model": MODEL_NAME, "prompt": "stream me", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.v1 + "/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert sum(1 for line in got if line.startswith("data: {")) >= 3
        assert held_blocks(live) > 0  # the request holds KV while it streams
    wait_until(lambda: held_blocks(live) == 0, what="KV usage back to 0 after the disconnect")
    wait_until(lambda: _abort_count(live) == before + 1, what="the request counted as aborted")
    st = live.engine.call_blocking(lambda e: e.stats())
    assert st.num_running == 0 and st.num_waiting == 0


def test_client_gone_before_a_non_streaming_answer_aborts_it(live):
    before = _abort_count(live)
    body = {"model": MODEL_NAME, "prompt": "wait for me", "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.v1 + "/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    wait_until(lambda: _abort_count(live) == before + 1, what="the request counted as aborted")
    wait_until(lambda: held_blocks(live) == 0, what="KV usage back to 0")
