"""Issue 12, defect 3: sessions belong to their owner; the tenant salts the prefix cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from kvserve.server.tenants import collect_keys, read_keys_file
from tests.server.conftest import MODEL_NAME, LiveServer, start_server

KEYS = {"key-alice": "alice", "key-bob": "bob"}
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # 3 full blocks of 4


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tenants(tiny_model) -> Iterator[LiveServer]:  # type: ignore[no-untyped-def]
    srv = start_server(tiny_model, api_keys=KEYS, max_waiting=None)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def shared(tiny_model) -> Iterator[LiveServer]:  # type: ignore[no-untyped-def]
    srv = start_server(tiny_model, api_keys=KEYS, share_prefix_cache_across_tenants=True, max_waiting=None)
    yield srv
    srv.stop()


def chat(srv: LiveServer, key: str, sid: str, text: str, **extra: object) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0, "session_id": sid,
            "messages": [{"role": "user", "content": text}], **extra}
    return httpx.post(srv.v1 + "/chat/completions", json=body, headers=auth(key), timeout=60)


def cached(srv: LiveServer, key: str, **extra: object) -> int:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, **extra}
    r = httpx.post(srv.v1 + "/completions", json=body, headers=auth(key), timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_tenant_sees_continues_and_deletes_only_its_own_sessions(tenants: LiveServer) -> None:
    assert chat(tenants, "key-alice", "conv-1", "secret plans").status_code == 200
    mine = httpx.get(tenants.v1 + "/sessions", headers=auth("key-alice")).json()["data"]
    assert [s["id"] for s in mine] == ["conv-1"]
    assert httpx.get(tenants.v1 + "/sessions", headers=auth("key-bob")).json()["data"] == []
    missing = httpx.get(tenants.v1 + "/sessions/never-made", headers=auth("key-bob"))
    other = httpx.get(tenants.v1 + "/sessions/conv-1", headers=auth("key-bob"))
    assert other.status_code == missing.status_code == 404
    assert other.json()["error"] == {**missing.json()["error"], "message": "no session 'conv-1'"}
    assert httpx.delete(tenants.v1 + "/sessions/conv-1", headers=auth("key-bob")).status_code == 404
    # bob's "conv-1" is his own, new session: he never sees alice's history
    r = chat(tenants, "key-bob", "conv-1", "hello", return_token_ids=True)
    assert r.status_code == 200
    bob_prompt = r.json()["prompt_token_ids"]
    alice = httpx.get(tenants.v1 + "/sessions/conv-1", headers=auth("key-alice")).json()
    assert len(bob_prompt) < alice["num_tokens"] or "secret" not in tenants.engine.engine.tokenizer.decode(bob_prompt)
    assert httpx.delete(tenants.v1 + "/sessions/conv-1", headers=auth("key-alice")).status_code == 200
    assert httpx.get(tenants.v1 + "/sessions/conv-1", headers=auth("key-bob")).status_code == 200
    assert httpx.delete(tenants.v1 + "/sessions/conv-1", headers=auth("key-bob")).status_code == 200


def test_missing_or_wrong_key_is_401(tenants: LiveServer) -> None:
    assert httpx.get(tenants.v1 + "/sessions").status_code == 401
    assert httpx.get(tenants.v1 + "/sessions", headers=auth("key-carol")).status_code == 401
    assert httpx.post(tenants.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(tenants.url + "/health").status_code == 200


def test_prefix_cache_is_salted_by_tenant(tenants: LiveServer) -> None:
    cached(tenants, "key-alice")
    assert cached(tenants, "key-alice") > 0
    assert cached(tenants, "key-bob") == 0  # bob cannot learn that alice sent this prompt


def test_empty_cache_salt_is_a_salt(tenants: LiveServer) -> None:
    salted = {"cache_salt": ""}
    cached(tenants, "key-alice")
    assert cached(tenants, "key-alice", **salted) == 0
    assert cached(tenants, "key-alice", **salted) > 0


def test_sharing_the_prefix_cache_across_tenants_is_opt_in(shared: LiveServer) -> None:
    cached(shared, "key-alice")
    assert cached(shared, "key-bob") > 0


def test_keys_from_file_flags_and_environment(tmp_path: Path) -> None:
    f = tmp_path / "keys.txt"
    f.write_text("# comment\nk1 team-a\n\nk2 team-b\n")
    assert read_keys_file(f) == {"k1": "team-a", "k2": "team-b"}
    keys = collect_keys(["flag-1", "flag-2"], str(f), "from-env")
    assert keys["k1"] == "team-a" and keys["from-env"] == "default"
    assert keys["flag-1"] != keys["flag-2"] and "flag-1" not in keys["flag-1"]
    f.write_text("only-a-key\n")
    with pytest.raises(ValueError, match="KEY TENANT"):
        read_keys_file(f)


def test_serve_help_lists_the_new_flags() -> None:
    import typer

    from kvserve.cli import app

    assert CliRunner().invoke(app, ["serve", "--help"]).exit_code == 0
    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    out = " ".join(opt for p in serve.params for opt in p.opts)
    for flag in ("--api-keys-file", "--share-prefix-cache-across-tenants", "--max-n", "--max-body-size",
                 "--kv-cache-dtype", "--kv-cache-memory", "--max-model-len", "--max-num-seqs",
                 "--session-idle-timeout", "--max-session-tokens", "--session-overflow"):
        assert flag in out, flag


def test_sessions_per_tenant_are_capped_per_tenant(tiny_model) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    from kvserve.config import CacheConfig
    from tests.server.conftest import engine_config

    if "max_sessions_per_tenant" not in {f.name for f in dataclasses.fields(CacheConfig)}:
        pytest.skip("the engine has no per-tenant session cap yet")
    cfg = engine_config(tiny_model)
    cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, max_sessions_per_tenant=2))
    srv = start_server(tiny_model, cfg, api_keys=KEYS, max_waiting=None)
    try:
        assert chat(srv, "key-bob", "b-0", "bob's").status_code == 200
        for i in range(3):
            assert chat(srv, "key-alice", f"a-{i}", f"question {i}").status_code == 200
        alice = {s["id"] for s in httpx.get(srv.v1 + "/sessions", headers=auth("key-alice")).json()["data"]}
        assert alice == {"a-1", "a-2"}  # the least recently used one was forgotten
        bob = {s["id"] for s in httpx.get(srv.v1 + "/sessions", headers=auth("key-bob")).json()["data"]}
        assert bob == {"b-0"}  # another tenant's sessions do not count
    finally:
        srv.stop()
