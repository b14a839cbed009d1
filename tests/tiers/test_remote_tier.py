"""The remote tier on a real Redis: another engine on the same Redis continues a session from it;
Redis going away mid-run fails no request; a corrupted object in Redis is never served."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from kvserve import LLM, SamplingParams
from kvserve.kv.tiers.remote import PREFIX
from tests.engine.conftest import write_tiny_llama

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
TURNS = [{"prompt_token_ids": [10 + 7 * t + i for i in range(6)]} for t in range(4)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("remote") / "m")


def engine(model: Path, **kw) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(model), dtype="float32", kv_cache_memory="2MiB", block_size=4, num_threads=1, **kw)


def test_another_instance_continues_a_session_from_redis(model: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    uninterrupted = engine(model)
    expected = [uninterrupted.generate(t, GREEDY, session_id="s")[0] for t in TURNS]
    a = engine(model, kv_remote=redis_server.url)
    for t, want in zip(TURNS[:3], expected):
        assert a.generate(t, GREEDY, session_id="s")[0].outputs[0].token_ids == want.outputs[0].token_ids
    history = len(a.engine.kv.sessions.get("s").token_ids)
    b = engine(model, kv_remote=redis_server.url)  # another instance: nothing local, same Redis
    assert [s.session_id for s in b.engine.list_sessions()] == ["s"]
    out = b.generate(TURNS[3], GREEDY, session_id="s")[0]
    assert out.outputs[0].token_ids == expected[3].outputs[0].token_ids
    assert out.kv_hit_tokens.get("remote", 0) >= 0.95 * (history - 4)
    # one key per block: every block object is a single value
    client = redis.Redis.from_url(redis_server.url)
    assert len(list(client.scan_iter(match=PREFIX + b"*"))) >= history // 4


def test_redis_going_away_fails_no_request(model: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    plain = engine(model)
    reference = [plain.generate(t, GREEDY)[0].outputs[0].token_ids for t in TURNS]
    llm = engine(model, kv_remote=redis_server.url)
    assert llm.generate(TURNS[0], GREEDY)[0].outputs[0].token_ids == reference[0]
    redis_server.stop()
    outs = [llm.generate(t, GREEDY)[0] for t in TURNS]
    assert [o.outputs[0].token_ids for o in outs] == reference and all(o.error is None for o in outs)
    remote = llm.engine.runner.tiers.tiers[0]
    assert not remote.up and remote.stats.errors >= 1
    llm.engine.kv.check()


def test_a_corrupted_object_in_redis_is_never_served(model: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    prompt = {"prompt_token_ids": list(range(200, 240))}
    reference = engine(model).generate(prompt, GREEDY)[0].outputs[0].token_ids
    engine(model, kv_remote=redis_server.url).generate(prompt, GREEDY, session_id="c")
    client = redis.Redis.from_url(redis_server.url)
    for key in client.scan_iter(match=PREFIX + b"*"):
        data = bytearray(client.get(key))
        data[-20] ^= 0x55
        client.set(key, bytes(data))
    b = engine(model, kv_remote=redis_server.url)
    out = b.generate({"prompt_token_ids": [1, 2]}, GREEDY, session_id="c")[0]
    assert out.kv_hit_tokens.get("remote", 0) == 0
    assert b.engine.runner.tiers.tiers[0].stats.checksum_failures >= 1
    assert b.generate(prompt, GREEDY)[0].outputs[0].token_ids == reference
