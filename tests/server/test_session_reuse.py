"""Issue 12, defects 6 and 8: a session id reused for another conversation starts afresh; a
session that outgrows its cap gets a 400 that says what to do."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import pytest

from kvserve.config import CacheConfig
from tests.server.conftest import MODEL_NAME, LiveServer, engine_config, start_server


def turn(srv: LiveServer, sid: str, messages: list[dict[str, str]], **extra: object) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "session_id": sid,
            "messages": messages, **extra}
    return httpx.post(srv.v1 + "/chat/completions", json=body, timeout=60)


def session(srv: LiveServer, sid: str) -> dict:  # type: ignore[type-arg]
    return httpx.get(srv.v1 + f"/sessions/{sid}", timeout=30).json()  # type: ignore[no-any-return]


def reply(r: httpx.Response) -> dict[str, str]:
    assert r.status_code == 200, r.text
    return {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}


def test_exact_extension_and_new_only_turns_append(live: LiveServer) -> None:
    sid = "reuse-append"
    u1, u2, u3 = ({"role": "user", "content": c} for c in ("first", "second", "third"))
    r1 = turn(live, sid, [u1])
    a1 = reply(r1)
    n1 = session(live, sid)["num_tokens"]
    r2 = turn(live, sid, [u1, a1, u2])  # the whole conversation again: an extension
    assert r2.status_code == 200 and "session_restarted" not in r2.json()
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    n2 = session(live, sid)["num_tokens"]
    assert n2 > n1
    r3 = turn(live, sid, [u3])  # only the new message
    assert r3.status_code == 200 and "session_restarted" not in r3.json()
    assert session(live, sid)["num_tokens"] > n2
    httpx.delete(live.v1 + f"/sessions/{sid}")


def test_resending_another_conversation_restarts_the_session(live: LiveServer) -> None:
    sid = "CONV_ID_0"
    u1, u2 = {"role": "user", "content": "tell me a story"}, {"role": "user", "content": "go on"}
    a1 = reply(turn(live, sid, [u1]))
    reply(turn(live, sid, [u1, a1, u2]))
    long_history = session(live, sid)["num_tokens"]
    # a second benchmark run: the first turn of the same conversation again
    again = turn(live, sid, [u1], return_token_ids=True)
    assert again.status_code == 200 and again.json()["session_restarted"] is True
    assert again.headers["x-session-restarted"] == "true"
    fresh = turn(live, "reuse-fresh", [u1], return_token_ids=True)
    assert again.json()["prompt_token_ids"] == fresh.json()["prompt_token_ids"]  # no old context
    assert session(live, sid)["num_tokens"] < long_history
    # a conversation with a different assistant reply in it: not this session's history
    other = turn(live, sid, [u1, {"role": "assistant", "content": "something else"}, u2])
    assert other.status_code == 200 and other.json()["session_restarted"] is True
    for s in (sid, "reuse-fresh"):
        httpx.delete(live.v1 + f"/sessions/{s}")


def test_a_stream_reports_the_restart_in_a_header(live: LiveServer) -> None:
    sid = "reuse-stream"
    u1 = {"role": "user", "content": "hello"}
    a1 = reply(turn(live, sid, [u1]))
    reply(turn(live, sid, [u1, a1, {"role": "user", "content": "more"}]))
    with httpx.stream("POST", live.v1 + "/chat/completions", timeout=60,
                      json={"model": MODEL_NAME, "max_tokens": 2, "stream": True, "session_id": sid,
                            "messages": [u1]}) as r:
        assert r.status_code == 200 and r.headers.get("x-session-restarted") == "true"
        assert any(line == "data: [DONE]" for line in r.iter_lines())
    httpx.delete(live.v1 + f"/sessions/{sid}")


@pytest.fixture(scope="module")
def capped(tiny_model) -> Iterator[LiveServer]:  # type: ignore[no-untyped-def]
    cfg = engine_config(tiny_model)
    cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, max_session_tokens=48))
    assert isinstance(cfg.cache, CacheConfig)
    srv = start_server(tiny_model, cfg, max_waiting=None)
    yield srv
    srv.stop()


def test_a_session_over_its_cap_gets_a_400_that_says_what_to_do(capped: LiveServer) -> None:
    sid = "capped"
    first = turn(capped, sid, [{"role": "user", "content": "a fairly long question to fill the session"}])
    assert first.status_code == 200, first.text
    msg = [{"role": "user", "content": "and a second question, also long enough"}]  # new only: appended
    r = turn(capped, sid, msg)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "drop_oldest" in err["message"] and "\x1f" not in err["message"]
    assert err["param"] == "session_id" and err["code"] == "session_too_long"
    # per request: drop the oldest turns instead (when the engine takes the field)
    dropped = turn(capped, sid, msg, session_overflow="drop_oldest")
    assert dropped.status_code in (200, 400), dropped.text
    if dropped.status_code == 400:
        assert "session_overflow" in dropped.json()["error"]["message"]
    bad = turn(capped, sid, msg, session_overflow="truncate")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_overflow"


def test_a_session_over_max_model_len_is_told_what_to_do(live: LiveServer) -> None:
    sid = "outgrown"
    for i in range(2):
        r = turn(live, sid, [{"role": "user", "content": f"turn {i}"}], max_tokens=100)
        assert r.status_code == 200, r.text
    r = turn(live, sid, [{"role": "user", "content": "one more"}], max_tokens=100)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "session_id" and err["code"] == "session_too_long"
    assert "max_model_len" in err["message"] and f"DELETE /v1/sessions/{sid}" in err["message"]
    assert "\x1f" not in err["message"]
    httpx.delete(live.v1 + f"/sessions/{sid}")
