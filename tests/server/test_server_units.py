"""Small pieces of the server without HTTP: stop-string hold-back, percentiles, chat-session turns,
config loading and the ``serve`` command line."""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from kvserve.config_file import DeploymentExtras, write_config_file
from kvserve.model.loader import load_tokenizer
from kvserve.request import CompletionOutput, RequestOutput
from kvserve.server.cli import build_engine_config
from kvserve.server.config import ServerConfig
from kvserve.server.sessions import ChatSessions
from kvserve.server.streaming import Deltas
from kvserve.server.timeline import percentile


def out(text: str, ids: list[int], reason: str | None = None, index: int = 0) -> CompletionOutput:
    return CompletionOutput(index=index, text=text, token_ids=ids, finish_reason=reason)


def test_deltas_hold_back_what_could_become_a_stop_string():
    d = Deltas.for_stops(("STOP",))
    assert d.take(0, out("Hello S", [1, 2])) == ("Hell", [1, 2], 0, False)  # "o S" might start "STOP"
    assert d.take(0, out("Hello ST", [1, 2, 3])) == ("o", [3], 2, False)
    assert d.take(0, out("Hello ", [1, 2, 3, 4], "stop")) == (" ", [4], 3, True)  # the engine cut "STOP"
    assert d.take(0, out("Hello ", [1, 2, 3, 4], "stop")) is None  # finished choices say nothing more
    free = Deltas.for_stops(())
    assert free.take(1, out("abc", [7])) == ("abc", [7], 0, False)
    assert free.take(1, out("abc", [7])) is None


@pytest.mark.parametrize("values, q, expected", [([], 50, None), ([3.0], 95, 3.0), ([4, 1, 3, 2], 50, 2),
                                                   ([4, 1, 3, 2], 95, 4), (list(range(1, 101)), 95, 95)])
def test_percentile_nearest_rank(values, q, expected):
    assert percentile(values, q) == expected


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(str(tiny_model))


def template(tok, messages) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def turn(sessions: ChatSessions, sid: str, messages: list, engine_tokens: int | None) -> tuple[list[int], int]:
    """Plan a chat turn and commit it as the engine accepted it: (the ids sent, the version)."""
    plan = sessions.plan(sid, messages, engine_tokens)
    return plan.ids, sessions.commit(sid, plan)


def finish(sessions, sid, version, prompt_ids, reply_ids, text):
    """The engine finished the turn; returns the engine session's length (prompt + reply)."""
    final = RequestOutput("r", None, prompt_ids, [out(text, reply_ids, "stop")], True)
    sessions.end_turn(sid, version, final)
    return len(prompt_ids) + len(reply_ids)


def test_chat_session_sends_only_new_tokens_whichever_way_the_client_sends_history(tokenizer):
    u1, u2 = {"role": "user", "content": "first question"}, {"role": "user", "content": "second"}
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    reply_ids = tokenizer.encode("an answer", add_special_tokens=False) + [eos]
    reply = {"role": "assistant", "content": "an answer"}
    history_text = None
    for resend_all in (False, True):
        s = ChatSessions(tokenizer)
        ids1, v1 = turn(s, "s", [u1], None)
        assert tokenizer.decode(ids1, skip_special_tokens=False) == template(tokenizer, [u1])
        n = finish(s, "s", v1, ids1, reply_ids, "an answer")
        plan = s.plan("s", [u1, reply, u2] if resend_all else [u2], n)
        assert not plan.restart and plan.new_messages == [u2]
        text = tokenizer.decode(ids1 + reply_ids + plan.ids, skip_special_tokens=False)
        assert text == template(tokenizer, [u1, reply, u2])  # as if the whole conversation were templated
        assert history_text in (None, text)
        history_text = text


def test_chat_session_rules_abandon_stale_and_restart(tokenizer):
    s = ChatSessions(tokenizer)
    u, u2 = {"role": "user", "content": "hi"}, {"role": "user", "content": "and then"}
    ids, v = turn(s, "s", [u], None)
    n = finish(s, "s", v, ids, [5, 6], "xy")
    follow = s.plan("s", [u2], n)
    assert s.plan("s", [u2], n).ids == follow.ids  # planning changes nothing
    alone = ChatSessions(tokenizer).plan("s", [u2], None).ids  # u2 templated as a first message
    assert follow.ids != alone  # a continuation is templated after the history
    v2 = s.commit("s", follow)
    s.end_turn("s", v2, None)  # aborted: the record is as before the turn
    assert s.plan("s", [u2], n).ids == follow.ids
    s.end_turn("s", v2, None)  # a stale version is a no-op
    assert s.plan("s", [u2], n).ids == follow.ids
    # the engine session changed behind our back (e.g. a completions call): template afresh
    assert s.plan("s", [u2], n + 3).ids == alone
    # another conversation under this id (it holds an assistant turn we never gave): restart
    other = [{"role": "user", "content": "elsewhere"}, {"role": "assistant", "content": "ok"}, u2]
    restart = s.plan("s", other, n)
    assert restart.restart and restart.new_messages == other
    assert tokenizer.decode(restart.ids, skip_special_tokens=False) == template(tokenizer, other)
    s.forget("s")
    assert len(s) == 0


def test_build_engine_config_reads_the_planner_file_and_flags_win(tmp_path, tiny_model):
    eng = EngineConfig(model=str(tiny_model), dtype="float32",
                       cache=CacheConfig(block_size=8, kv_cache_memory=64 * 2**20),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=128))
    path = write_config_file(tmp_path / "plan.json", eng, DeploymentExtras(session_idle_timeout_s=42))
    cfg = build_engine_config(None, str(path))
    assert cfg.model == str(tiny_model) and cfg.cache.block_size == 8 and cfg.scheduler.max_num_seqs == 8
    assert cfg.cache.session_idle_timeout_s == 42
    over = build_engine_config(None, str(path), max_model_len=64, kv_cache_memory="1MiB", dtype="bfloat16")
    assert over.scheduler.max_model_len == 64 and over.cache.kv_cache_memory == 2**20 and over.dtype == "bfloat16"
    # the flags changed only what they name; everything else still comes from the file
    assert over.cache.block_size == 8 and over.scheduler.max_num_seqs == 8 and over.model == str(tiny_model)
    assert over.cache.session_idle_timeout_s == 42
    assert dataclasses.replace(over.cache, kv_cache_memory=cfg.cache.kv_cache_memory) == cfg.cache
    assert dataclasses.replace(over.scheduler, max_model_len=cfg.scheduler.max_model_len) == cfg.scheduler
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "x", "cache": {"block_size": "big"}}')
    with pytest.raises(ValueError, match="block_size"):
        build_engine_config(None, str(bad))


def test_speculative_settings_round_trip_the_config_file_and_the_flags(tmp_path, tiny_model):
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3, ngram_min=1, max_num_seqs=2)
    eng = EngineConfig(model=str(tiny_model), scheduler=SchedulerConfig(speculative=spec))
    path = write_config_file(tmp_path / "plan.json", eng, DeploymentExtras())
    assert build_engine_config(None, str(path)).scheduler.speculative == spec
    flags = build_engine_config(None, str(path), num_speculative_tokens=5).scheduler.speculative
    assert flags == dataclasses.replace(spec, num_speculative_tokens=5)
    assert build_engine_config(str(tiny_model), None, speculative="ngram").scheduler.speculative.enabled
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "x", "scheduler": {"speculative": {"method": "eagle"}}}')
    with pytest.raises(ValueError, match="speculative"):
        build_engine_config(None, str(bad))
    draft = build_engine_config(str(tiny_model), None, speculative="draft", draft_model=str(tiny_model))
    assert draft.scheduler.speculative == SpeculativeConfig("draft", draft_model=str(tiny_model))
    path = write_config_file(tmp_path / "draft.json", draft, DeploymentExtras())
    assert build_engine_config(None, str(path)).scheduler.speculative == draft.scheduler.speculative
    with pytest.raises(ValueError, match="needs draft_model"):
        build_engine_config(str(tiny_model), None, speculative="draft")


@pytest.mark.parametrize("kwargs, match", [({"port": 70000}, "port"), ({"api_key": " "}, "api_key"),
                                           ({"max_waiting": -1}, "max_waiting"), ({"served_model_name": ""}, "served")])
def test_server_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerConfig(**kwargs)


def test_serve_command_is_registered():
    from kvserve.cli import app

    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0
    for flag in ("--model", "--config", "--host", "--port", "--api-key", "--served-model-name", "--max-waiting"):
        assert flag in result.output
    assert "127.0.0.1" in result.output
