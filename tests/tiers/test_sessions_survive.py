"""A session's record and KV survive the engine: a new engine on the same disk directory (what a
restart after kill -9 sees) lists the session, and its next turn gives the tokens an uninterrupted
run gives, with the history's KV loaded from the disk tier instead of recomputed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from tests.engine.conftest import write_tiny_llama

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
TURNS = [{"prompt_token_ids": [10 + 7 * t + i for i in range(6)]} for t in range(6)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("survive") / "m")


def engine(model: Path, **kw) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(model), dtype="float32", kv_cache_memory="2MiB", block_size=4, num_threads=1, **kw)


def test_a_restarted_engine_continues_the_session_from_disk(model: Path, tmp_path: Path) -> None:
    uninterrupted = engine(model)
    expected = [uninterrupted.generate(t, GREEDY, session_id="s")[0] for t in TURNS]
    first = engine(model, kv_disk_dir=tmp_path)
    for t, want in zip(TURNS[:5], expected):
        assert first.generate(t, GREEDY, session_id="s")[0].outputs[0].token_ids == want.outputs[0].token_ids
    history = len(first.engine.kv.sessions.get("s").token_ids)
    del first  # nothing is flushed at exit: everything needed was written as it happened
    second = engine(model, kv_disk_dir=tmp_path)
    assert [s.session_id for s in second.engine.list_sessions()] == ["s"]
    out = second.generate(TURNS[5], GREEDY, session_id="s")[0]
    assert out.outputs[0].token_ids == expected[5].outputs[0].token_ids
    assert out.prompt_token_ids == expected[5].prompt_token_ids
    assert out.num_cached_tokens >= 0.95 * (history - 4)  # all but the partial last block
    assert out.kv_hit_tokens.get("disk", 0) == out.num_cached_tokens
    second.engine.kv.check()


def test_a_closed_session_is_gone_after_a_restart(model: Path, tmp_path: Path) -> None:
    llm = engine(model, kv_disk_dir=tmp_path)
    llm.generate(TURNS[0], GREEDY, session_id="gone")
    llm.generate(TURNS[0], GREEDY, session_id="kept")
    assert llm.close_session("gone")
    assert [s.session_id for s in engine(model, kv_disk_dir=tmp_path).engine.list_sessions()] == ["kept"]
