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

from kvserve.engine.async_engine import EngineDeadError, RequestStream
from kvserve.request import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import APIError
from kvserve.server.params import refuse_unsupported, sampling_params, session_id_of, usage_of
from kvserve.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from kvserve.server.state import ServerState, unless_disconnected
from kvserve.server.streaming import DONE, Deltas, completion_logprobs, error_event, merge, sse

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


async def create_completion(state: ServerState, request: Request, body: bytes) -> JSONResponse | StreamingResponse:
    req = CompletionRequest.model_validate_json(body)
    state.check_model(req.model)
    refuse_unsupported(req)
    sid = session_id_of(req.session_id, request.headers.get("x-session-id"))
    prompts = _prompts(req.prompt)
    if sid is not None and (len(prompts) != 1 or req.n != 1):
        raise APIError(400, "a session continues one conversation: send one prompt with n=1", param="session_id")
    params = sampling_params(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs)
    state.check_queue()
    streams = await _add(state, req, prompts, params, sid)
    rid = f"cmpl-{uuid.uuid4().hex}"
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(state, req, rid, streams, include_usage, params.stop),
                                 media_type="text/event-stream")
    finals = await unless_disconnected(request, _collect(streams))
    return JSONResponse(_response(state, req, rid, finals).model_dump(exclude_none=True))


async def _add(state: ServerState, req: CompletionRequest, prompts: list[Prompt], params: SamplingParams,
               sid: str | None) -> list[RequestStream]:
    engine = state.engine
    if sid is not None:
        state.chat_sessions.claim(sid)
        try:
            prompt = prompts[0]
            if isinstance(prompt, str):  # a continuation gets no BOS of its own
                known = await state.session(sid)
                prompt = list(state.tokenizer.encode(prompt, add_special_tokens=known is None))
            return [await engine.add_request(prompt, params, session_id=sid, cache_salt=req.cache_salt,
                                             on_done=lambda _out: state.chat_sessions.release(sid))]
        except BaseException:
            state.chat_sessions.release(sid)
            raise
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            try:
                streams.append(await engine.add_request(prompt, params, cache_salt=req.cache_salt))
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}" if len(prompts) > 1 else str(exc)) from None
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
                              usage=usage_of(finals))


async def _stream(state: ServerState, req: CompletionRequest, rid: str, streams: list[RequestStream],
                  include_usage: bool, stops: tuple[str, ...]) -> AsyncIterator[bytes]:
    created, model = int(time.time()), state.config.served_model_name
    deltas = Deltas.for_stops(stops)
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in merge(streams):
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
            usage = usage_of([finals[i] for i in sorted(finals)])
            yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage))
        yield DONE
    except EngineDeadError as exc:
        yield error_event(503, str(exc))
    finally:
        for s in streams:
            s.abort()
