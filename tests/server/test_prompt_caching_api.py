"""The prompt-caching API through the server: ``cache_control`` on a message (or a content part)
and ``prompt_cache_key`` pin a prefix; ``usage`` splits cache writes from cache reads in the
names hosted APIs use, priced apart; misuse is a 400 with an OpenAI-style body."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.pricing import Prices
from tests.server.conftest import LiveServer, engine_config, start_server

SYSTEM = "You are a terse assistant. Answer in one word. " * 6


@pytest.fixture(scope="module")
def srv(tiny_model: Path) -> Iterator[LiveServer]:
    prices = Prices(input=1_000_000.0, cached_input=100_000.0, output=1_000_000.0, cache_write=1_250_000.0)
    s = start_server(tiny_model, engine_config(tiny_model), max_waiting=None, prices=prices)
    yield s
    s.stop()


def chat(srv: LiveServer, messages: list, **kw) -> httpx.Response:  # type: ignore[type-arg, no-untyped-def]
    body = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0, **kw}
    return httpx.post(srv.v1 + "/chat/completions", json=body, timeout=60)


def system(marker: dict | None = None) -> dict:  # type: ignore[type-arg]
    msg = {"role": "system", "content": SYSTEM}
    if marker is not None:
        msg["cache_control"] = marker
    return msg


def test_a_marked_system_prompt_is_written_once_then_read(srv: LiveServer) -> None:
    first = chat(srv, [system({"type": "ephemeral"}), {"role": "user", "content": "alpha?"}]).json()["usage"]
    written = first["cache_creation_input_tokens"]
    assert written > 0 and first["cache_read_input_tokens"] == 0
    assert first["prompt_tokens_details"]["cache_write_tokens"] == written
    assert first["cost"]["cache_write"] == written * 1.25 and first["cost"]["input"] == first["prompt_tokens"] - written
    second = chat(srv, [system({"type": "ephemeral", "ttl": "1h"}), {"role": "user", "content": "beta?"}]).json()["usage"]
    assert second["cache_read_input_tokens"] >= written and second["cache_creation_input_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == second["cache_read_input_tokens"]
    plain = chat(srv, [{"role": "user", "content": "no caching asked"}]).json()["usage"]
    assert "cache_creation_input_tokens" not in plain and "cache_write_tokens" not in plain["prompt_tokens_details"]
    deadline = time.monotonic() + 5
    while True:  # the engine snapshot behind /metrics is refreshed every 0.25 s
        m = srv.metrics()
        if m.get(("kvserve:prompt_cache_pins_created_total", ()), 0) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert m[("kvserve:prompt_cache_pins", ())] >= 1 and m[("kvserve:prompt_cache_pinned_blocks", ())] >= written // 4
    assert m[("kvserve:prompt_cache_pins_refreshed_total", ())] >= 1
    assert m[("kvserve:cost_total", (("kind", "cache_write"),))] >= written * 1.25


def test_a_content_part_marker_and_the_streamed_usage(srv: LiveServer) -> None:
    msgs = [{"role": "system", "content": [{"type": "text", "text": SYSTEM + " Part two.",
                                            "cache_control": {"type": "ephemeral", "ttl": "5m"}}]},
            {"role": "user", "content": "gamma?"}]
    body = {"model": "tiny", "messages": msgs, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", srv.v1 + "/chat/completions", json=body, timeout=60) as r:
        lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    usage = lines[-1]["usage"]
    assert usage["cache_creation_input_tokens"] > 0 and "cache_read_input_tokens" in usage


def test_prompt_cache_key_on_completions(srv: LiveServer) -> None:
    body = {"model": "tiny", "prompt": list(range(200, 240)), "max_tokens": 2, "temperature": 0,
            "prompt_cache_key": "tenant-agent-7"}
    first = httpx.post(srv.v1 + "/completions", json=body, timeout=60).json()["usage"]
    second = httpx.post(srv.v1 + "/completions", json=body, timeout=60).json()["usage"]
    assert first["cache_creation_input_tokens"] == 40 and first["cache_read_input_tokens"] == 0
    assert second["cache_read_input_tokens"] == 36 and second["cache_creation_input_tokens"] == 0


@pytest.mark.parametrize("kw, param", [
    ({"messages": [system({"type": "ephemeral", "ttl": "2h"})]}, "messages"),
    ({"messages": [system({"type": "persistent"})]}, "messages"),
    ({"messages": [system({"type": "ephemeral"})] * 5}, "messages"),
    ({"messages": [system({"type": "ephemeral"})], "session_id": "s1"}, "messages"),
    ({"messages": [system()], "prompt_cache_key": ""}, "prompt_cache_key"),
])
def test_misuse_is_a_400(srv: LiveServer, kw: dict, param: str) -> None:  # type: ignore[type-arg]
    body = {"model": "tiny", "max_tokens": 2, **kw}
    r = httpx.post(srv.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert param in (err.get("param") or "")
