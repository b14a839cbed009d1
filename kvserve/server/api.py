"""The FastAPI app: OpenAI-compatible endpoints, sessions, health, metrics and the dashboard.

    GET  /health                    200 while the engine thread runs, else 503
    GET  /v1/models
    POST /v1/completions            stream, n, stop, seed, logprobs, session_id
    POST /v1/chat/completions       stream, n, stop, seed, logprobs/top_logprobs, session_id
    GET  /v1/sessions               DELETE /v1/sessions/{id}    GET /v1/sessions/{id}
    GET  /metrics                   Prometheus text, prefix kvserve:
    GET  /dashboard                 live page; it polls GET /dashboard/data every second

``/v1/*`` needs ``Authorization: Bearer <key>`` when the server has an API key; health, metrics
and the dashboard do not (they carry no prompts or outputs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server.chat import create_chat_completion
from kvserve.server.completions import create_completion
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError, install_handlers
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import ModelCard, ModelList, SessionCard, SessionList
from kvserve.server.sessions import ChatSessions
from kvserve.server.state import ClientDisconnected, ServerState
from kvserve.server.timeline import Timeline

log = logging.getLogger("kvserve.server")
DASHBOARD_HTML = Path(__file__).resolve().parent / "dashboard" / "index.html"


def create_app(engine: AsyncLLMEngine, config: ServerConfig, model_path: str = "",
               own_engine: bool = True) -> FastAPI:
    """An app serving ``engine``. Its lifespan starts the engine thread and the dashboard sampler
    and, if ``own_engine``, shuts the engine down at exit."""
    state = ServerState(engine, config, model_path, ServerMetrics(config.served_model_name),
                        Timeline(config.dashboard_points), ChatSessions(engine.engine.tokenizer))
    engine.listeners.extend([state.metrics, state.timeline])

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        sampler = asyncio.create_task(_sample_forever(state))
        try:
            yield
        finally:
            sampler.cancel()
            if own_engine:
                await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="kvserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvserve = state
    install_handlers(app)
    app.include_router(_v1_router(state))
    _add_plain_routes(app, state)
    return app


async def _sample_forever(state: ServerState) -> None:
    """One dashboard point (and a fresh metrics snapshot) per interval."""
    while True:
        await asyncio.sleep(state.config.sample_interval_s)
        if not state.engine.alive:
            continue
        try:
            snap = await state.engine.snapshot()
        except Exception:  # the engine died between the check and the call
            log.exception("dashboard sampling failed")
            continue
        state.metrics.set_snapshot(snap)
        state.timeline.sample(snap)


def _v1_router(state: ServerState) -> APIRouter:
    async def require_key(request: Request) -> None:
        key = state.config.api_key
        if key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        if given is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
        if not secrets.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @router.get("/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=state.config.served_model_name, created=state.started, root=state.model_path,
                         max_model_len=state.max_model_len)
        return ModelList(data=[card]).model_dump()

    @router.post("/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await _guarded(request, create_completion(state, request, await request.body()))

    @router.post("/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await _guarded(request, create_chat_completion(state, request, await request.body()))

    @router.get("/sessions")
    async def list_sessions() -> dict[str, Any]:
        cards = [_card(s) for s in await state.engine.list_sessions()]
        return SessionList(data=cards).model_dump()

    @router.get("/sessions/{session_id}")
    async def get_session(session_id: str) -> dict[str, Any]:
        info = await state.session(session_id)
        if info is None:
            raise APIError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")
        return _card(info).model_dump()

    @router.delete("/sessions/{session_id}")
    async def delete_session(session_id: str) -> dict[str, Any]:
        closed = await state.engine.close_session(session_id)
        state.chat_sessions.forget(session_id)
        if not closed:
            raise APIError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    return router


def _card(s: Any) -> SessionCard:
    return SessionCard(id=s.session_id, num_tokens=s.num_tokens, resident=s.resident,
                       pinned_blocks=s.pinned_blocks, busy=s.busy, idle_s=round(s.idle_s, 3))


async def _guarded(request: Request, coro: Any) -> Response:
    try:
        return await coro
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the request was aborted


def _add_plain_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", response_model=None)
    async def health() -> Response:
        if state.engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "error": repr(state.engine.error)}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.engine.alive:
            state.metrics.set_snapshot(await state.engine.snapshot())
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(DASHBOARD_HTML, media_type="text/html")

    @app.get("/dashboard/data")
    async def dashboard_data() -> dict[str, Any]:
        eng = state.engine.engine
        info = {"model": state.config.served_model_name, "model_path": state.model_path,
                "block_size": eng.capacity.block_size, "blocks_total": eng.capacity.num_blocks,
                "kv_bytes_per_token": eng.capacity.bytes_per_token,
                "token_capacity": eng.capacity.token_capacity, "max_model_len": state.max_model_len,
                "interval_s": state.config.sample_interval_s, "alive": state.engine.alive}
        return state.timeline.data(info)
