"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Handlers turn every failure a client can cause into one of these, with the status code OpenAI
uses: 400 bad input, 401 API key, 404 unknown model/session/route, 409 session busy, 413 body
too large, 429 queue full (with ``Retry-After``), 500 one request failed inside the engine (the
others go on), 503 engine down.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_engine import EngineDeadError
from kvserve.server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("kvserve.server")

_TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
                   500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, param=self.param, code=self.code, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, object]:
    info = ErrorInfo(message=message, type=_TYPE_OF_STATUS.get(status, "invalid_request_error"),
                     param=param, code=code)
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_errors(errors: list[Any]) -> APIError:
    """The first problem of a pydantic error list, as a 400 naming the field. Unknown fields are
    named all at once."""
    extra = [_loc(e) for e in errors if e.get("type") == "extra_forbidden"]
    if extra:
        names = ", ".join(f"'{n}'" for n in extra[:10])
        return APIError(400, f"unknown field{'s' if len(extra) > 1 else ''} {names}: kvserve refuses fields it "
                             f"does not know rather than ignoring them (see docs/server.md)",
                        param=extra[0], code="unknown_field")
    err = errors[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}",
                        code="invalid_json")
    param = _loc(err) or None
    got = json.dumps(err.get("input"), default=str)[:80] if "input" in err else ""
    where = f"field '{param}': " if param else ""
    return APIError(400, f"{where}{err['msg']} (got {got})" if got else f"{where}{err['msg']}", param=param,
                    code=err["type"])


def _loc(err: Any) -> str:
    parts = [str(p) for p in err.get("loc", ()) if not str(p).startswith(("function-", "union["))]
    if parts[:1] == ["body"]:
        parts = parts[1:]
    if len(parts) > 1 and parts[0] in ("TokenizeCompletionRequest", "TokenizeChatRequest"):
        parts = parts[1:]
    return ".".join(parts)


def from_validation_error(exc: ValidationError) -> APIError:
    return from_errors(list(exc.errors()))


def from_value_error(exc: ValueError) -> APIError:
    msg = str(exc)
    if "already serving a turn" in msg:
        return APIError(409, msg, param="session_id", code="session_busy")
    if "max_session_tokens" in msg or "outgrow" in msg:
        return APIError(400, msg, param="session_id", code="session_too_long")
    param = "max_tokens" if "max_model_len" in msg or "KV pool" in msg else None
    return APIError(400, msg, param=param)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        if not errors:
            return APIError(400, "invalid request body").response()
        if errors[0].get("type") == "missing" and tuple(errors[0].get("loc", ())) == ("body",):
            return APIError(400, "malformed JSON body: the body is empty; send a JSON object",
                            code="invalid_json").response()
        return from_errors(errors).response()

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        return from_value_error(exc).response()

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), code="engine_dead")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _other(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
