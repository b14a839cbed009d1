"""``POST /v1/chat/completions``: messages through the model's chat template, ``n`` samples.

Without a session the whole conversation is templated and tokenized (the prefix cache still finds
the earlier turns). With a session only the new messages' tokens are sent; the engine appends them
to the session's history and reuses its pinned KV (see :mod:`kvserve.server.sessions`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from kvserve.engine.async_engine import EngineDeadError, RequestStream
from kvserve.engine.chat_session import Message
from kvserve.server.errors import APIError
from kvserve.server.params import (
    default_chat_max_tokens,
    refuse_unsupported,
    sampling_params,
    session_id_of,
    usage_of,
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
from kvserve.server.streaming import DONE, Deltas, chat_logprobs, error_event, sse


def chat_token_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """The whole conversation through the chat template, with the generation prompt."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template refusing the messages is the client's error
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def _messages(req: ChatCompletionRequest) -> list[Message]:
    out = []
    for m in req.messages:
        msg = {"role": m.role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


async def create_chat_completion(state: ServerState, request: Request, body: bytes) -> JSONResponse | StreamingResponse:
    req = ChatCompletionRequest.model_validate_json(body)
    state.check_model(req.model)
    refuse_unsupported(req)
    sid = session_id_of(req.session_id, request.headers.get("x-session-id"))
    if sid is not None and req.n != 1:
        raise APIError(400, "a session continues one conversation: use n=1 with session_id", param="n")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    top_n = req.top_logprobs or 0
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    state.check_queue()
    stream = await _add(state, req, _messages(req), sid, max_tokens, top_n if req.logprobs else None)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(state, req, rid, stream, include_usage, top_n, sid),
                                 media_type="text/event-stream")
    final = await unless_disconnected(request, stream.result())
    choices = [ChatChoice(index=c.index, message=ChatMessageOut(content=c.text), finish_reason=c.finish_reason,
                          stop_reason=c.stop_reason, logprobs=chat_logprobs(state.tokenizer, c, 0, top_n),
                          token_ids=c.token_ids if req.return_token_ids else None) for c in final.outputs]
    resp = ChatCompletionResponse(id=rid, model=state.config.served_model_name, choices=choices,
                                  usage=usage_of([final]), session_id=sid,
                                  prompt_token_ids=final.prompt_token_ids if req.return_token_ids else None)
    return JSONResponse(resp.model_dump(exclude_none=True))


async def _add(state: ServerState, req: ChatCompletionRequest, messages: list[Message], sid: str | None,
               max_tokens: int | None, logprobs: int | None) -> RequestStream:
    engine, sessions = state.engine, state.chat_sessions
    if sid is None:
        ids = chat_token_ids(state.tokenizer, messages)
        mt = max_tokens if max_tokens is not None else default_chat_max_tokens(len(ids), state.max_model_len)
        return await engine.add_request(ids, sampling_params(req, mt, logprobs), cache_salt=req.cache_salt)
    known = await state.session(sid)
    ids = sessions.begin_turn(sid, messages, known.num_tokens if known else None)
    try:
        history = known.num_tokens if known else 0
        mt = max_tokens if max_tokens is not None else default_chat_max_tokens(history + len(ids), state.max_model_len)
        return await engine.add_request(ids, sampling_params(req, mt, logprobs), session_id=sid,
                                        cache_salt=req.cache_salt, on_done=lambda out: sessions.end_turn(sid, out))
    except BaseException:
        sessions.abandon_turn(sid)
        raise


async def _stream(state: ServerState, req: ChatCompletionRequest, rid: str, stream: RequestStream,
                  include_usage: bool, top_n: int, sid: str | None) -> AsyncIterator[bytes]:
    created, model = int(time.time()), state.config.served_model_name

    def chunk(choices: list[ChatStreamChoice], **kw: Any) -> bytes:
        return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, **kw))

    deltas = Deltas.for_stops(tuple([req.stop] if isinstance(req.stop, str) else req.stop or []))
    try:
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(req.n)])
        final = None
        async for out in stream:
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
        if include_usage and final is not None:
            yield chunk([], usage=usage_of([final]))
        yield DONE
    except EngineDeadError as exc:
        yield error_event(503, str(exc))
    finally:
        stream.abort()
