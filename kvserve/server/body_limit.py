"""Request bodies are bounded: 413 with an OpenAI error before the body is read in full.

A ``Content-Length`` over the limit is refused before a byte of the body is read; a chunked
body is read until it passes the limit, then refused. The refused body is never buffered or
parsed: after the 413's status line its bytes are discarded as they arrive (at most
``DRAIN_BYTES``), so that a client still uploading can read the answer instead of a connection
reset; then the connection is closed. Otherwise the body (at most the limit) is buffered here and
replayed to the app, so the app never sees more than ``max_body_bytes``; after the replay the
app's ``receive`` is the server's again (disconnect detection keeps working).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvserve.server.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
DRAIN_BYTES = 64 * 2**20


def _as_json(scope: Scope, chunks: list[bytes]) -> Scope:
    """A JSON body sent without a JSON content type (``curl -d`` says form-urlencoded) is read as
    JSON, as OpenAI's API does, instead of failing validation as a non-object."""
    headers = list(scope.get("headers") or [])
    kind = dict(headers).get(b"content-type", b"").split(b";")[0].strip().lower()
    head = next((c for c in chunks if c.strip()), b"").lstrip()[:1]
    if kind in (b"", b"application/x-www-form-urlencoded", b"text/plain") and head in (b"{", b"["):
        headers = [(k, v) for k, v in headers if k != b"content-type"] + [(b"content-type", b"application/json")]
        return {**scope, "headers": headers}
    return scope


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > self.limit:
                await self._too_large(send, receive, f"{declared} bytes", done=False)
                return
        chunks: list[bytes] = []
        total = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > self.limit:
                await self._too_large(send, receive, f"more than {self.limit} bytes",
                                      done=not msg.get("more_body", False))
                return
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False
        scope = _as_json(scope, chunks)

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, receive: Receive, got: str, done: bool) -> None:
        body = json.dumps(error_body(413, f"the request body ({got}) is over this server's limit of "
                                          f"{self.limit} bytes (--max-body-size)",
                                     code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        drained = 0
        while not done and drained < DRAIN_BYTES:  # discard, so the client gets to read the 413
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            drained += len(msg.get("body", b""))
            done = not msg.get("more_body", False)
        await send({"type": "http.response.body", "body": body})
