"""``POST /v1/chat/completions``: messages through the model's chat template, ``n`` samples.

Without a session the whole conversation is templated and tokenized on a tokenizer worker (the
prefix cache still finds the earlier turns). With a session only the new messages' tokens are
sent; the engine appends them to the session's history and reuses its pinned KV, or the turn
restarts the session when the client resends another conversation (see
:mod:`kvserve.server.sessions`).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from kvserve.engine.async_engine import EngineDeadError, RequestStream, SessionChangedError
from kvserve.engine.chat_session import Message
from kvserve.request import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import APIError
from kvserve.server.params import (
    cache_breakpoints,
    check_limits,
    check_response_format,
    default_chat_max_tokens,
    refuse_caching_in_session,
    refuse_unsupported,
    sampling_params,
    session_id_of,
    usage_of,
    uses_prompt_caching,
)
from kvserve.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
)
from kvserve.server.state import ServerState, unless_disconnected
from kvserve.server.streaming import DONE, Deltas, chat_logprobs, error_event, failure_of, sse


def render_chat(tokenizer: Any, messages: list[Message], add_generation_prompt: bool = True) -> str:
    try:
        return str(tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt))
    except Exception as exc:  # noqa: BLE001 - a template refusing the messages is the client's error
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None


def chat_token_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """The whole conversation through the chat template, with the generation prompt."""
    return list(tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False))


def _prefix_tokens(tokenizer: Any, head: list[Message], ids: list[int]) -> int:
    """How many of the prompt's tokens ``head`` (its first messages, no generation prompt) covers:
    the common prefix of the two renderings, so a template that renders a message differently
    when more follow can only shorten the cached prefix, never cache a wrong one."""
    mine = tokenizer.encode(render_chat(tokenizer, head, add_generation_prompt=False), add_special_tokens=False)
    n = 0
    for a, b in zip(mine, ids):
        if a != b:
            break
        n += 1
    return n


def _messages(req: ChatCompletionRequest) -> list[Message]:
    out = []
    for m in req.messages:
        msg = {"role": m.role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


@dataclasses.dataclass
class _Added:
    stream: RequestStream
    restarted: bool = False
    session: tuple[str, int] | None = None  # (engine session id, transcript version) of a session turn


async def create_chat_completion(state: ServerState, request: Request, req: ChatCompletionRequest,
                                 tenant: str) -> JSONResponse | StreamingResponse:
    state.check_model(req.model)
    refuse_unsupported(req)
    check_limits(req, state.config, state.vocab_size)
    sid = session_id_of(req.session_id, request.headers.get("x-session-id"))
    if sid is not None and req.n != 1:
        raise APIError(400, "a session continues one conversation: use n=1 with session_id", param="n")
    refuse_caching_in_session(req, sid)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    top_n = req.top_logprobs or 0
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # validated before any tokenizing; max_tokens is settled once the prompt's length is known
    provisional = max_tokens if max_tokens is not None else max(1, req.min_tokens)
    params = sampling_params(req, provisional, top_n if req.logprobs else None,
                             state.tokenizer, state.vocab_size)
    await state.tokenizers.run(lambda tok: check_response_format(tok, params, state.vocab_size))
    state.check_queue(req.n)
    added = await _add(state, req, _messages(req), sid, tenant, max_tokens, params)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    headers = {"X-Session-Restarted": "true"} if added.restarted else None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(state, req, rid, added, include_usage, top_n),
                                 media_type="text/event-stream", headers=headers)
    final: RequestOutput = await unless_disconnected(request, added.stream.result())
    failed = failure_of(final)
    if failed is not None:
        raise APIError(500, failed, code="request_failed")
    await _record_turn(state, added, final)
    choices = [ChatChoice(index=c.index, message=ChatMessageOut(content=c.text),
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                          logprobs=chat_logprobs(state.tokenizer, c, 0, top_n),
                          token_ids=c.token_ids if req.return_token_ids else None) for c in final.outputs]
    resp = ChatCompletionResponse(id=rid, model=state.config.served_model_name, choices=choices,
                                  usage=usage_of([final], state.config.prices, uses_prompt_caching(req)),
                                  session_id=sid,
                                  session_restarted=True if added.restarted else None,
                                  prompt_token_ids=final.prompt_token_ids if req.return_token_ids else None)
    return JSONResponse(resp.model_dump(exclude_none=True), headers=headers)


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    try:
        return dataclasses.replace(params, max_tokens=max_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc), param="max_tokens") from None


async def _add(state: ServerState, req: ChatCompletionRequest, messages: list[Message], sid: str | None,
               tenant: str, max_tokens: int | None, params: SamplingParams) -> _Added:
    engine = state.engine
    salt = state.salt(tenant, req.cache_salt)
    overflow = req.session_overflow or state.config.session_overflow
    if sid is None:
        marks = cache_breakpoints(req)

        def encode(tok: Any) -> tuple[list[int], list[tuple[int, float]]]:
            text = render_chat(tok, messages)
            state.check_bytes(text, 0, max_tokens, "messages")
            ids = list(tok.encode(text, add_special_tokens=False))
            return ids, [(n, ttl) for i, ttl in marks if (n := _prefix_tokens(tok, messages[:i + 1], ids))]

        ids, pins = await state.tokenizers.run(encode)
        mt = max_tokens if max_tokens is not None else default_chat_max_tokens(len(ids), state.max_model_len)
        stream = await engine.add_request(ids, _with_max_tokens(params, mt), cache_salt=salt,
                                          kv_cache_dtype=req.kv_cache_dtype, cache_control=pins,
                                          prompt_cache_key=req.prompt_cache_key, kv_press=req.kv_press)
        return _Added(stream)
    esid, sessions = state.session_id(tenant, sid), state.chat_sessions
    for attempt in range(3):
        async with sessions.lock(esid):
            known = await state.session(esid)
            if known is not None and known.busy:
                raise APIError(409, f"session {sid!r} is already serving a turn; wait for it to finish",
                               param="session_id", code="session_busy")
            have = known.num_tokens if known is not None else None
            meta = known.meta if known is not None else None
            plan = await state.tokenizers.run(
                lambda tok, have=have, meta=meta: sessions.plan(esid, messages, have, tok, meta))
            history = 0 if plan.restart or have is None else have
            mt = max_tokens if max_tokens is not None else default_chat_max_tokens(history + len(plan.ids),
                                                                                    state.max_model_len)
            version = sessions.commit(esid, plan)
            try:
                stream = await engine.add_request(
                    plan.ids, _with_max_tokens(params, mt), session_id=esid, cache_salt=salt,
                    kv_cache_dtype=req.kv_cache_dtype, kv_press=req.kv_press, session_overflow=overflow, tenant=tenant,
                    check_session=True,
                    restart_session=plan.restart, expect_session_tokens=have,
                    on_done=lambda out, v=version: _end_turn(state, esid, v, out))  # type: ignore[misc]
            except SessionChangedError:
                sessions.end_turn(esid, version, None)
                if attempt == 2:
                    raise APIError(409, f"session {sid!r} changed while this turn was prepared; retry",
                                   param="session_id", code="session_busy") from None
                continue
            except ValueError as exc:
                sessions.end_turn(esid, version, None)
                raise session_error(str(exc), esid, sid, history) from None
            except BaseException:
                sessions.end_turn(esid, version, None)
                raise
            return _Added(stream, plan.restart, (esid, version))
    raise AssertionError("unreachable")


def session_error(msg: str, engine_id: str, sid: str, history: int) -> Exception:
    """An engine refusal of a session turn, in the client's words (the engine names the namespaced
    id), and with what to do when the session has outgrown the context or the pool."""
    msg = msg.replace(repr(engine_id), repr(sid)).replace(engine_id, sid)
    if history and ("max_model_len" in msg or "KV pool" in msg):
        return APIError(400, f"{msg}. Session {sid!r} already holds {history} tokens: close it "
                             f"(DELETE /v1/sessions/{sid}) and start a new one, lower max_tokens, or let the server "
                             "drop the oldest turns (session_overflow: 'drop_oldest' with --max-session-tokens)",
                        param="session_id", code="session_too_long")
    return ValueError(msg)


async def _stream(state: ServerState, req: ChatCompletionRequest, rid: str, added: _Added,
                  include_usage: bool, top_n: int) -> AsyncIterator[bytes]:
    stream = added.stream
    created, model = int(time.time()), state.config.served_model_name

    def chunk(choices: list[ChatStreamChoice], **kw: Any) -> bytes:
        return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, **kw))

    deltas = Deltas.for_stops(tuple([req.stop] if isinstance(req.stop, str) else req.stop or []))
    try:
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(req.n)])
        final = None
        async for out in stream:
            failed = failure_of(out)
            if failed is not None:
                yield error_event(500, failed, code="request_failed")
                return
            for c in out.outputs:
                got = deltas.take(c.index, c)
                if got is None:
                    continue
                text, ids, start, finished = got
                yield chunk([ChatStreamChoice(
                    index=c.index, delta=DeltaMessage(content=text or None),
                    logprobs=chat_logprobs(state.tokenizer, c, start, top_n),
                    finish_reason=c.finish_reason if finished else None,
                    token_ids=ids if req.return_token_ids else None)])
            final = out
        if final is not None:
            await _record_turn(state, added, final)
        if include_usage and final is not None:
            yield chunk([], usage=usage_of([final], state.config.prices, uses_prompt_caching(req)))
        yield DONE
    except EngineDeadError as exc:
        yield error_event(503, str(exc))
    finally:
        stream.abort()


def _end_turn(state: Any, esid: str, version: int, out: Any) -> None:
    """The turn ended (whoever sees it first: the stream's callback or the handler; a second call
    is a no-op): update the transcript and persist it with the engine's session."""
    state.chat_sessions.end_turn(esid, version, out)
    meta = state.chat_sessions.meta_of(esid)
    if meta is not None:
        state.engine.post_session_meta(esid, meta)


async def _record_turn(state: Any, added: _Added, final: RequestOutput) -> None:
    """Before the client sees the reply: the transcript is updated and persisted with the engine's
    session (its record on disk or in Redis), so a crash right after the reply loses nothing."""
    if added.session is None:
        return
    esid, version = added.session
    state.chat_sessions.end_turn(esid, version, final)
    meta = state.chat_sessions.meta_of(esid)
    if meta is not None:
        await state.engine.set_session_meta(esid, meta)
