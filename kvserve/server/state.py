"""What every endpoint shares: the engine, the settings, metrics, the dashboard timeline, the
chat transcripts of sessions, the tokenizer pool, and who is asking."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from kvserve.engine.async_engine import AsyncLLMEngine, SessionInfo
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError
from kvserve.server.metrics import ServerMetrics
from kvserve.server.sessions import ChatSessions
from kvserve.server.tenants import engine_session_id, prefix_cache_salt
from kvserve.server.timeline import Timeline
from kvserve.server.tokenizing import TokenizerPool, min_tokens_of


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    config: ServerConfig
    model_path: str
    metrics: ServerMetrics
    timeline: Timeline
    chat_sessions: ChatSessions
    tokenizers: TokenizerPool
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return int(self.engine.engine.model_config.vocab_size)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(getattr(self.engine.engine, "_eos", ()))

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r}", param="model", code="model_not_found")

    def check_queue(self, num_seqs: int = 1) -> None:
        """429 when the request's ``num_seqs`` sequences would take the waiting queue past
        ``max_waiting``; 400 when they alone are more than it could ever hold."""
        limit = self.config.max_waiting
        if limit is None:
            return
        if num_seqs > limit:
            raise APIError(400, f"this request makes {num_seqs} sequences (n x prompts), more than the "
                                f"waiting queue holds (max_waiting={limit}); lower n or send fewer prompts",
                           param="n")
        waiting = self.engine.num_waiting
        if waiting + num_seqs > limit:
            raise APIError(429, f"the waiting queue is full ({waiting} sequences waiting, this request adds "
                                f"{num_seqs}, max_waiting={limit}); retry later", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)})

    def check_bytes(self, text: str, fixed_tokens: int, max_tokens: int | None, param: str) -> None:
        """400 before tokenizing when ``text``'s bytes prove the prompt is over ``max_model_len``."""
        least = min_tokens_of(text, self.tokenizers.max_token_bytes) + fixed_tokens
        need = least + (max_tokens or 1)
        if least and need > self.max_model_len:
            size = len(text.encode(errors="replace"))
            raise APIError(400, f"the prompt has at least {least} tokens ({size} bytes, no token longer "
                                f"than {self.tokenizers.max_token_bytes} bytes); with max_tokens "
                                f"{max_tokens or 1} that is over max_model_len ({self.max_model_len})",
                           param=param)

    def session_id(self, tenant: str, session_id: str) -> str:
        return engine_session_id(tenant, session_id)

    def salt(self, tenant: str, cache_salt: str | None) -> str | None:
        return prefix_cache_salt(tenant, cache_salt, self.config.share_prefix_cache_across_tenants)

    async def session(self, engine_session_id: str) -> SessionInfo | None:
        return await self.engine.session(engine_session_id)


class ClientDisconnected(Exception):
    """The HTTP client went away before its non-streaming answer was ready."""


async def unless_disconnected(request: Request, coro: Any) -> Any:
    """Await ``coro``; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(coro)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # the client is gone either way
        await task
    raise ClientDisconnected()
