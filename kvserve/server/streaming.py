"""Pieces shared by the completions and chat endpoints: merging streams, SSE framing, text deltas
with stop-string hold-back, and logprobs in both of OpenAI's shapes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from kvserve.engine.async_engine import RequestStream
from kvserve.request import CompletionOutput, RequestOutput
from kvserve.server.errors import error_body
from kvserve.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

DONE = b"data: [DONE]\n\n"


def sse(obj: BaseModel) -> bytes:
    return b"data: " + obj.model_dump_json(exclude_none=True).encode() + b"\n\n"


def error_event(status: int, message: str, code: str | None = None) -> bytes:
    """An error after the stream has started (the status line is already sent)."""
    return b"data: " + json.dumps(error_body(status, message, code=code)).encode() + b"\n\n" + DONE


def failure_of(out: RequestOutput) -> str | None:
    """Why the engine failed this request (a sample finished with reason "error"), or None.
    The engine's other requests go on; this one gets a 500 (or an error event)."""
    if not any(c.finish_reason == "error" for c in out.outputs):
        return None
    why = getattr(out, "error", None)
    return f"the request failed in the engine: {why}" if why else "the request failed in the engine"


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index. Closing the
    merged iterator early aborts every stream still running."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()  # a no-op once it finished
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((i, exc))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await q.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


@dataclass
class Deltas:
    """What each choice has been sent. Text that could still turn into a stop string (the last
    ``len(longest stop) - 1`` characters) is held back until the sample finishes, because the
    engine cuts a stop string out of text it has already reported."""

    holdback: int
    sent_chars: dict[int, int] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)

    @classmethod
    def for_stops(cls, stops: tuple[str, ...]) -> Deltas:
        return cls(max((len(s) for s in stops), default=1) - 1)

    def take(self, key: int, c: CompletionOutput) -> tuple[str, list[int], int, bool] | None:
        """(new text, new token ids, index of the first new token, finished now), or None if
        there is nothing new to send for this choice."""
        if key in self.done:
            return None
        finished = c.finish_reason is not None
        chars, toks = self.sent_chars.get(key, 0), self.sent_tokens.get(key, 0)
        end = len(c.text) if finished else max(chars, len(c.text) - self.holdback)
        text, ids = c.text[chars:end], c.token_ids[toks:]
        if not text and not ids and not finished:
            return None
        self.sent_chars[key], self.sent_tokens[key] = end, len(c.token_ids)
        if finished:
            self.done.add(key)
        return text, ids, toks, finished


def _token_text(tokenizer: Any, tid: int) -> str:
    return tokenizer.decode([tid], skip_special_tokens=False)


def completion_logprobs(tokenizer: Any, c: CompletionOutput, start: int, text_offset: int) -> CompletionLogprobs | None:
    """Legacy completions shape for tokens ``start:`` of a sample."""
    if c.logprobs is None:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    off = text_offset
    for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        tok = _token_text(tokenizer, tid)
        tokens.append(tok)
        lps.append(entry.get(tid))
        tops.append({_token_text(tokenizer, k): v for k, v in entry.items()})
        offsets.append(off)
        off += len(tok)
    return CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=offsets)


def chat_logprobs(tokenizer: Any, c: CompletionOutput, start: int, top_n: int) -> ChatLogprobs | None:
    """Chat shape for tokens ``start:`` of a sample: each token with its ``top_n`` alternatives."""
    if c.logprobs is None:
        return None
    content = []
    for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        tok = _token_text(tokenizer, tid)
        alts = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        top = [TopLogprob(token=_token_text(tokenizer, k), logprob=v,
                          bytes=list(_token_text(tokenizer, k).encode())) for k, v in alts]
        content.append(ChatTokenLogprob(token=tok, logprob=entry.get(tid, float("-inf")),
                                        bytes=list(tok.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)
