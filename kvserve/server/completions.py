"""``POST /v1/completions``: raw prompts (text or token ids, one or several), ``n`` samples each.

Choice ``index`` is ``prompt_index * n + sample_index``, as OpenAI numbers them. With a session the
prompt (one, ``n == 1``) is appended to the session's history as tokens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from kvserve.engine.async_engine import EngineDeadError, RequestStream, SessionChangedError
from kvserve.request import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.chat import session_error
from kvserve.server.errors import APIError
from kvserve.server.params import (
    check_limits,
    check_response_format,
    refuse_caching_in_session,
    refuse_unsupported,
    sampling_params,
    session_id_of,
    usage_of,
    uses_prompt_caching,
)
from kvserve.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from kvserve.server.state import ServerState, unless_disconnected
from kvserve.server.streaming import DONE, Deltas, completion_logprobs, error_event, failure_of, merge, sse

Prompt = str | list[int]


def _prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty; give a string, a list of token ids, or a list of those",
                       param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


async def create_completion(state: ServerState, request: Request, req: CompletionRequest,
                            tenant: str) -> JSONResponse | StreamingResponse:
    state.check_model(req.model)
    refuse_unsupported(req)
    check_limits(req, state.config, state.vocab_size)
    sid = session_id_of(req.session_id, request.headers.get("x-session-id"))
    prompts = _prompts(req.prompt)
    if sid is not None and (len(prompts) != 1 or req.n != 1):
        raise APIError(400, "a session continues one conversation: send one prompt with n=1", param="session_id")
    params = sampling_params(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs,
                             state.tokenizer, state.vocab_size)
    await state.tokenizers.run(lambda tok: check_response_format(tok, params, state.vocab_size))
    state.check_queue(req.n * len(prompts))
    streams = await _add(state, req, prompts, params, sid, tenant)
    rid = f"cmpl-{uuid.uuid4().hex}"
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(state, req, rid, streams, include_usage, params.stop),
                                 media_type="text/event-stream")
    finals = await unless_disconnected(request, _collect(streams))
    for out in finals:
        failed = failure_of(out)
        if failed is not None:
            raise APIError(500, failed, code="request_failed")
    return JSONResponse(_response(state, req, rid, finals).model_dump(exclude_none=True))


async def _tokens(state: ServerState, prompt: Prompt, bos: bool, max_tokens: int) -> list[int]:
    """Token ids of a prompt: text is tokenized on a worker thread (after the byte bound)."""
    if not isinstance(prompt, str):
        return prompt
    if not prompt:
        raise APIError(400, "the prompt is empty; give at least one token", param="prompt")

    def encode(tok: object) -> list[int]:
        state.check_bytes(prompt, 0, max_tokens, "prompt")
        return list(tok.encode(prompt, add_special_tokens=bos))  # type: ignore[attr-defined]

    return await state.tokenizers.run(encode)


async def _add(state: ServerState, req: CompletionRequest, prompts: list[Prompt], params: SamplingParams,
               sid: str | None, tenant: str) -> list[RequestStream]:
    engine = state.engine
    salt = state.salt(tenant, req.cache_salt)
    refuse_caching_in_session(req, sid)
    if sid is not None:
        esid = state.session_id(tenant, sid)
        overflow = req.session_overflow or state.config.session_overflow
        for attempt in range(3):
            async with state.chat_sessions.lock(esid):
                known = await state.session(esid)
                if known is not None and known.busy:
                    raise APIError(409, f"session {sid!r} is already serving a turn; wait for it to finish",
                                   param="session_id", code="session_busy")
                # a continuation gets no BOS of its own
                ids = await _tokens(state, prompts[0], known is None, params.max_tokens)
                try:
                    return [await engine.add_request(
                        ids, params, session_id=esid, cache_salt=salt, kv_cache_dtype=req.kv_cache_dtype, kv_press=req.kv_press,
                        session_overflow=overflow, tenant=tenant, check_session=True,
                        expect_session_tokens=None if known is None else known.num_tokens)]
                except SessionChangedError:
                    if attempt == 2:
                        raise APIError(409, f"session {sid!r} changed while this turn was prepared; retry",
                                       param="session_id", code="session_busy") from None
                except ValueError as exc:
                    raise session_error(str(exc), esid, sid, 0 if known is None else known.num_tokens) from None
        raise AssertionError("unreachable")
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            try:
                ids = await _tokens(state, prompt, True, params.max_tokens)
                streams.append(await engine.add_request(ids, params, cache_salt=salt,
                                                        kv_cache_dtype=req.kv_cache_dtype, kv_press=req.kv_press,
                                                        prompt_cache_key=req.prompt_cache_key))
            except (ValueError, APIError) as exc:
                if len(prompts) == 1:
                    raise
                if isinstance(exc, APIError):
                    exc.message = f"prompt {i}: {exc.message}"
                    raise
                raise ValueError(f"prompt {i}: {exc}") from None
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge(streams):
        if out.finished:
            finals[i] = out
    return [f for f in finals if f is not None]


def _response(state: ServerState, req: CompletionRequest, rid: str, finals: list[RequestOutput]) -> CompletionResponse:
    choices = []
    for i, out in enumerate(finals):
        for c in out.outputs:
            choices.append(CompletionChoice(
                index=i * req.n + c.index, text=c.text, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason, logprobs=completion_logprobs(state.tokenizer, c, 0, 0),
                token_ids=c.token_ids if req.return_token_ids else None,
                prompt_token_ids=out.prompt_token_ids if req.return_token_ids and c.index == 0 else None,
            ))
    return CompletionResponse(id=rid, model=state.config.served_model_name, choices=choices,
                              usage=usage_of(finals, state.config.prices, uses_prompt_caching(req)))


async def _stream(state: ServerState, req: CompletionRequest, rid: str, streams: list[RequestStream],
                  include_usage: bool, stops: tuple[str, ...]) -> AsyncIterator[bytes]:
    created, model = int(time.time()), state.config.served_model_name
    deltas = Deltas.for_stops(stops)
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in merge(streams):
            failed = failure_of(out)
            if failed is not None:
                yield error_event(500, failed, code="request_failed")
                return
            for c in out.outputs:
                key = i * req.n + c.index
                got = deltas.take(key, c)
                if got is None:
                    continue
                text, ids, start, finished = got
                lp = completion_logprobs(state.tokenizer, c, start, deltas.sent_chars[key] - len(text))
                choice = CompletionChoice(index=key, text=text, logprobs=lp,
                                          finish_reason=c.finish_reason if finished else None,
                                          stop_reason=c.stop_reason if finished else None,
                                          token_ids=ids if req.return_token_ids else None)
                yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[choice]))
            if out.finished:
                finals[i] = out
        if include_usage:
            usage = usage_of([finals[i] for i in sorted(finals)], state.config.prices, uses_prompt_caching(req))
            yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage))
        yield DONE
    except EngineDeadError as exc:
        yield error_event(503, str(exc))
    finally:
        for s in streams:
            s.abort()
