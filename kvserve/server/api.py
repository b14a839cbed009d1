"""The FastAPI app: OpenAI-compatible endpoints, sessions, health, metrics and the dashboard.

    GET  /health                    200 while the engine thread runs, else 503
    GET  /version                   {"version"}
    GET  /v1/models
    POST /v1/completions            stream, n, stop, seed, logprobs, session_id
    POST /v1/chat/completions       stream, n, stop, seed, logprobs/top_logprobs, session_id
    GET  /v1/sessions               DELETE /v1/sessions/{id}    GET /v1/sessions/{id}   (the caller's own)
    POST /tokenize, /detokenize     vLLM's shapes
    GET  /metrics                   Prometheus text, prefixes kvserve: and vllm:
    GET  /dashboard                 live page; it polls GET /dashboard/data every second

``/v1/*``, ``/tokenize`` and ``/detokenize`` need ``Authorization: Bearer <key>`` when the server
has API keys; each key is a tenant that sees only its own sessions. Health, version, metrics and
the dashboard do not (they carry no prompts, outputs or session ids: docs/server.md, Security).
Every request body is declared in the OpenAPI schema (``/openapi.json``); a body that does not
fit it is a 400 in OpenAI's error shape, never FastAPI's 422.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server.body_limit import BodyLimitMiddleware
from kvserve.server.chat import create_chat_completion
from kvserve.server.completions import create_completion
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError, install_handlers
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    SessionCard,
    SessionDeleted,
    SessionList,
)
from kvserve.server.routes_tokens import add_token_routes
from kvserve.server.sessions import ChatSessions
from kvserve.server.state import ClientDisconnected, ServerState
from kvserve.server.tenants import engine_session_id, own_session_id, tenant_of
from kvserve.server.timeline import Timeline
from kvserve.server.tokenizing import TokenizerPool

log = logging.getLogger("kvserve.server")
DASHBOARD_HTML = Path(__file__).resolve().parent / "dashboard" / "index.html"
PRUNE_EVERY_S = 10.0

ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse}
                                           for code in (400, 401, 404, 409, 413, 429, 500, 503)}
SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def create_app(engine: AsyncLLMEngine, config: ServerConfig, model_path: str = "",
               own_engine: bool = True) -> FastAPI:
    """An app serving ``engine``. Its lifespan starts the engine thread and the dashboard sampler
    and, if ``own_engine``, shuts the engine down at exit."""
    tokenizer = engine.engine.tokenizer
    state = ServerState(engine, config, model_path, ServerMetrics(config.served_model_name, config.prices),
                        Timeline(config.dashboard_points), ChatSessions(tokenizer),
                        TokenizerPool(tokenizer, config.tokenizer_workers))
    engine.listeners.extend([state.metrics, state.timeline])
    if hasattr(engine, "metrics_collector"):  # replicas (kvserve/cluster): per-replica series
        state.metrics.registry.register(engine.metrics_collector(config.served_model_name))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        sampler = asyncio.create_task(_sample_forever(state))
        try:
            yield
        finally:
            sampler.cancel()
            state.tokenizers.shutdown()
            if own_engine:
                await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="kvserve", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvserve = state
    install_handlers(app)

    async def current_tenant(request: Request) -> str:
        return tenant_of(request, state.config.keys)

    app.include_router(_v1_router(state, current_tenant))
    add_token_routes(app, state, current_tenant, ERRORS)
    _add_plain_routes(app, state)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes)
    _openapi_without_422(app)
    return app


def _openapi_without_422(app: FastAPI) -> None:
    """Invalid bodies are 400s in OpenAI's shape (declared per route), never FastAPI's 422."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original()
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvserve")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0.0.0"


async def _sample_forever(state: ServerState) -> None:
    """One dashboard point (and a fresh metrics snapshot) per interval; now and then, drop the
    transcripts of sessions the engine has forgotten."""
    last_prune = 0.0
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(state.config.sample_interval_s)
        if not state.engine.alive:
            continue
        try:
            snap = await state.engine.snapshot()
            if loop.time() - last_prune > PRUNE_EVERY_S and len(state.chat_sessions):
                state.chat_sessions.prune(await state.engine.session_ids())
                last_prune = loop.time()
        except Exception:  # the engine died between the check and the call
            log.exception("dashboard sampling failed")
            continue
        state.metrics.set_snapshot(snap)
        state.timeline.sample(snap)


def _v1_router(state: ServerState, current_tenant: Any) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models", response_model=ModelList, responses=ERRORS)
    async def models(_: str = Depends(current_tenant)) -> dict[str, Any]:
        card = ModelCard(id=state.config.served_model_name, created=state.started, root=state.model_path,
                         max_model_len=state.max_model_len,
                         kv_cache_dtype=getattr(state.engine.engine, "kv_dtype", None))
        return ModelList(data=[card]).model_dump()

    @router.post("/completions", response_model=None,
                 responses={200: {"model": CompletionResponse, "content": SSE}, **ERRORS})
    async def completions(request: Request, body: CompletionRequest,
                          tenant: str = Depends(current_tenant)) -> Response:
        return await _guarded(create_completion(state, request, body, tenant))

    @router.post("/chat/completions", response_model=None,
                 responses={200: {"model": ChatCompletionResponse, "content": SSE}, **ERRORS})
    async def chat_completions(request: Request, body: ChatCompletionRequest,
                               tenant: str = Depends(current_tenant)) -> Response:
        return await _guarded(create_chat_completion(state, request, body, tenant))

    @router.get("/sessions", response_model=SessionList, responses=ERRORS)
    async def list_sessions(tenant: str = Depends(current_tenant)) -> dict[str, Any]:
        infos = await state.engine.list_sessions(prefix=engine_session_id(tenant, ""))
        cards = [_card(s, own_session_id(tenant, s.session_id) or "") for s in infos]
        return SessionList(data=cards).model_dump()

    @router.get("/sessions/{session_id}", response_model=SessionCard, responses=ERRORS)
    async def get_session(session_id: str, tenant: str = Depends(current_tenant)) -> dict[str, Any]:
        info = await state.session(engine_session_id(tenant, session_id))
        if info is None:
            raise _no_session(session_id)
        return _card(info, session_id).model_dump()

    @router.delete("/sessions/{session_id}", response_model=SessionDeleted, responses=ERRORS)
    async def delete_session(session_id: str, tenant: str = Depends(current_tenant)) -> dict[str, Any]:
        esid = engine_session_id(tenant, session_id)
        closed = await state.engine.close_session(esid)
        state.chat_sessions.forget(esid)
        if not closed:
            raise _no_session(session_id)
        return SessionDeleted(id=session_id, deleted=True).model_dump()

    return router


def _no_session(session_id: str) -> APIError:
    """The same answer for an id nobody uses and another tenant's id."""
    return APIError(404, f"no session {session_id[:128]!r}", param="session_id", code="session_not_found")


def _card(s: Any, client_id: str) -> SessionCard:
    return SessionCard(id=client_id, num_tokens=s.num_tokens, resident=s.resident,
                       pinned_blocks=s.pinned_blocks, busy=s.busy, idle_s=round(s.idle_s, 3))


async def _guarded(coro: Any) -> Response:
    try:
        return await coro  # type: ignore[no-any-return]
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the request was aborted


def _add_plain_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", response_model=None, responses={503: {"description": "the engine stopped"}})
    async def health() -> Response:
        if state.engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "error": repr(state.engine.error)}, status_code=503)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
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
                "kv_bytes_per_token": eng.capacity.bytes_per_token, "kv_cache_dtype": getattr(eng, "kv_dtype", None),
                "token_capacity": eng.capacity.token_capacity, "max_model_len": state.max_model_len,
                "interval_s": state.config.sample_interval_s, "alive": state.engine.alive}
        if hasattr(state.engine, "replica_table"):
            info["replicas"] = state.engine.replica_table()
        return state.timeline.data(info)
