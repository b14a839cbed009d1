"""Bad input and limits: OpenAI error bodies, status codes, and no blocks lost on disconnect."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, engine_config, held_blocks, start_server, wait_until
from tests.step_gate import StepGate

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
    for extra, param in (({"tools": [{"type": "function"}]}, "tools"),
                         ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
                         ({"prediction": {"type": "content", "content": "x"}}, "prediction")):
        msg = assert_error(httpx.post(live.v1 + "/chat/completions", json={**CHAT, **extra}), 400, param=param)
        assert "not supported" in msg
    for extra, param in (({"suffix": "tail"}, "suffix"), ({"echo": True}, "echo")):
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, **extra}
        assert "not supported" in assert_error(httpx.post(live.v1 + "/completions", json=body), 400, param=param)


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


def first_data_line(lines) -> str:  # type: ignore[no-untyped-def]
    for line in lines:
        if line.startswith("data: {"):
            return line
    raise AssertionError("the stream ended before its first token")


def test_full_waiting_queue_is_429_with_retry_after(strict):
    """One request running (it cannot finish: the engine takes at most 20 steps of its 480 tokens
    until the test is done), one waiting, a third refused."""
    auth = {"Authorization": "Bearer sekret"}
    long = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with StepGate(strict.engine.engine) as gate:
        gate.allow(20)
        with httpx.stream("POST", strict.v1 + "/completions", json=long, headers=auth, timeout=30) as running:
            lines = running.iter_lines()  # keep a reference: a dropped iterator closes the connection
            first_data_line(lines)  # the first token: it runs (max_num_seqs=1)
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
    with StepGate(live.engine.engine) as gate:
        gate.allow(20)  # at most 20 of its 240 tokens: it is still running when the client leaves
        with httpx.stream("POST", live.v1 + "/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            first_data_line(lines)
            assert held_blocks(live) > 0  # the request holds KV while it streams
        wait_until(lambda: held_blocks(live) == 0, what="KV usage back to 0 after the disconnect")
        st = live.engine.call_blocking(lambda e: e.stats())
        assert st.num_running == 0 and st.num_waiting == 0
    wait_until(lambda: _abort_count(live) == before + 1, what="the request counted as aborted")


def test_client_disconnect_aborts_every_sample_of_an_n_request(live):
    body = {"model": MODEL_NAME, "prompt": "two at once", "max_tokens": 240, "n": 2, "temperature": 1.0,
            "seed": 5, "ignore_eos": True, "stream": True}
    with StepGate(live.engine.engine) as gate:
        gate.allow(20)  # neither sample can finish while the test runs
        with httpx.stream("POST", live.v1 + "/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()  # keep a reference: a dropped iterator closes the connection
            first_data_line(lines)
            wait_until(lambda: live.engine.call_blocking(lambda e: e.stats().num_running) == 2,
                       what="both samples running")
        wait_until(lambda: held_blocks(live) == 0, what="both samples' KV back after the disconnect")
        st = live.engine.call_blocking(lambda e: e.stats())
        assert st.num_running == 0 and st.num_waiting == 0


def test_client_gone_before_a_non_streaming_answer_aborts_it(live):
    before = _abort_count(live)
    body = {"model": MODEL_NAME, "prompt": "wait for me", "max_tokens": 240, "ignore_eos": True}
    with StepGate(live.engine.engine) as gate:
        gate.allow(5)  # admitted and holding KV, but 5 steps cannot produce 240 tokens: no answer comes
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.v1 + "/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
        wait_until(lambda: held_blocks(live) == 0, what="KV usage back to 0")
        assert live.engine.call_blocking(lambda e: e.stats().num_running) == 0
    wait_until(lambda: _abort_count(live) == before + 1, what="the request counted as aborted")


def test_a_fatal_engine_error_fails_the_request_and_health_reports_it(tiny_model):
    srv = start_server(tiny_model, engine_config(tiny_model), max_waiting=None)
    try:
        engine = srv.engine.engine
        real_step = engine.step

        def step_that_dies():  # type: ignore[no-untyped-def]
            if engine.has_unfinished_requests():
                raise RuntimeError("device lost")
            return real_step()  # idle ticks before the request still work

        engine.step = step_that_dies  # type: ignore[method-assign]
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        r = httpx.post(srv.v1 + "/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3},
                       timeout=30)
        assert "device lost" in assert_error(r, 503, code="engine_dead")
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503
        assert health.json()["status"] == "error" and "device lost" in health.json()["error"]
        again = httpx.post(srv.v1 + "/chat/completions", json=CHAT, timeout=30)  # refused, not queued
        assert_error(again, 503, code="engine_dead")
        assert httpx.get(srv.url + "/metrics").status_code == 200  # still scrapeable
    finally:
        srv.stop()
