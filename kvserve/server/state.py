"""What every endpoint shares: the engine, the settings, metrics, the dashboard timeline and the
chat transcripts of sessions."""

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
from kvserve.server.timeline import Timeline


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    config: ServerConfig
    model_path: str
    metrics: ServerMetrics
    timeline: Timeline
    chat_sessions: ChatSessions
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r}", param="model", code="model_not_found")

    def check_queue(self) -> None:
        """429 when the waiting queue is full (``max_waiting``)."""
        limit = self.config.max_waiting
        if limit is not None and self.engine.num_waiting >= limit:
            raise APIError(429, f"the waiting queue is full ({self.engine.num_waiting} requests waiting, "
                                f"max_waiting={limit}); retry later", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)})

    async def session(self, session_id: str) -> SessionInfo | None:
        return next((s for s in await self.engine.list_sessions() if s.session_id == session_id), None)


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
