"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version``, in vLLM's shapes.

``/tokenize`` takes ``{"prompt": str, "add_special_tokens": true}`` (as completions tokenizes) or
``{"messages": [...], "add_generation_prompt": true}`` (through the chat template, as chat
does) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes
``{"tokens": [...]}`` and answers ``{"prompt"}``. Both run on the tokenizer workers and need the
API key when the server has one; ``/version`` is open.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI

from kvserve.server.chat import render_chat
from kvserve.server.errors import APIError
from kvserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from kvserve.server.state import ServerState


def add_token_routes(app: FastAPI, state: ServerState, current_tenant: Any,
                     errors: dict[int | str, Any]) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse, responses=errors)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest,
                       _: str = Depends(current_tenant)) -> dict[str, Any]:
        state.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            if any(m.tool_calls for m in body.messages):
                raise APIError(400, "tool_calls are not supported by kvserve", param="messages")
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]

            def encode_chat(tok: Any) -> list[int]:
                text = render_chat(tok, messages, body.add_generation_prompt)
                return list(tok.encode(text, add_special_tokens=body.add_special_tokens))

            ids = await state.tokenizers.run(encode_chat)
        else:
            prompt, special = body.prompt, body.add_special_tokens
            ids = await state.tokenizers.run(lambda tok: list(tok.encode(prompt, add_special_tokens=special)))
        strs = None
        if body.return_token_strs:
            strs = await state.tokenizers.run(lambda tok: [str(s) for s in tok.convert_ids_to_tokens(ids)])
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids,
                                token_strs=strs).model_dump(exclude_none=True)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=errors)
    async def detokenize(body: DetokenizeRequest, _: str = Depends(current_tenant)) -> dict[str, Any]:
        state.check_model(body.model)
        vocab = state.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be token ids in [0, {vocab}); got {bad[:5]}", param="tokens")
        ids = list(body.tokens)
        text = await state.tokenizers.run(lambda tok: str(tok.decode(ids)))
        return DetokenizeResponse(prompt=text).model_dump()

    @app.get("/version", response_model=VersionResponse)
    async def version() -> dict[str, Any]:
        return VersionResponse(version=app.version).model_dump()
