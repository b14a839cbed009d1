"""Constrained decoding for ``response_format`` (``json_object``, ``json_schema``) with xgrammar.

Why xgrammar: measured on this repo's 2-core CPU with the shipped 4,096-token byte-level BPE
tokenizer, filling the next-token bitmask and accepting the token took a median of 7-8 µs per
token (p90 12 µs) for both a JSON object and a JSON schema, against 11-22 µs (p90 48-72 µs) for
llguidance 1.9.1; outlines-core 0.2.14 has no generic JSON-object grammar (regex only) and its
schema regex rejected ordinary whitespace. Compiling a grammar takes ~5 ms and is cached by the
compiler; the tokenizer's info is built once per tokenizer (~25 ms here). vLLM and SGLang use it.

Use, per request (the runner owns one matcher per sequence)::

    m = from_tokenizer(tokenizer, params.response_format, vocab_size=V, stop_token_ids=eos_ids)
    each step:  logits = m.apply(logits)         # or logits.masked_fill(~m.allowed_mask(V), -inf)
                token = sample(logits); m.accept(token)
    m.is_terminated()                            # a stop token was accepted after complete JSON

``from_tokenizer`` returns None for ``None`` / ``{"type": "text"}``. A bad schema raises
ValueError (the server turns it into a 400 before the request reaches the engine:
``validate_response_format``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import torch

_lock = threading.Lock()
_compilers: dict[tuple[int, int, tuple[int, ...]], tuple[Any, Any]] = {}


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def _compiler(tokenizer: Any, vocab_size: int | None, stop_token_ids: Sequence[int]) -> Any:
    """One GrammarCompiler per (tokenizer, vocab size, stop ids); it caches compiled grammars."""
    key = (id(tokenizer), vocab_size or 0, tuple(stop_token_ids))
    with _lock:
        hit = _compilers.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        xgr = _xgr()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        compiler = xgr.GrammarCompiler(info, max_threads=2)
        _compilers[key] = (tokenizer, compiler)
        return compiler


def json_schema_of(response_format: dict[str, Any] | None) -> dict[str, Any] | bool | None:
    """The JSON schema a response format asks for (None: unconstrained)."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format json_schema needs "
                             "{'json_schema': {'name': ..., 'schema': {...}}}")
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return schema
    raise ValueError(f"unsupported response_format type {kind!r}; use text, json_object or json_schema")


class Matcher:
    """The grammar state of one sequence."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        xgr = _xgr()
        self._m = matcher
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def _fill(self) -> torch.Tensor:
        self._m.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask

    def allowed_mask(self, vocab_size: int | None = None) -> torch.Tensor:
        """``[vocab_size]`` bool: True where the next token may be."""
        size = vocab_size or self.vocab_size
        words = self._fill()[0]
        shifts = torch.arange(32, dtype=torch.int32)
        bits = ((words.unsqueeze(-1) >> shifts) & 1).reshape(-1).bool()
        if bits.numel() < size:
            bits = torch.cat([bits, torch.zeros(size - bits.numel(), dtype=torch.bool)])
        return bits[:size]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask disallowed tokens of ``logits`` (``[V]`` or ``[1, V]``, float32 on CPU) with -inf; returns
        a new tensor."""
        mask = self.allowed_mask(logits.shape[-1])
        return logits.masked_fill(~mask, float("-inf"))

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False if the grammar does not allow it (state unchanged)."""
        return bool(self._m.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


def from_tokenizer(tokenizer: Any, response_format: dict[str, Any] | None, *, vocab_size: int | None = None,
                   stop_token_ids: Sequence[int] = ()) -> Matcher | None:
    """A fresh matcher for ``response_format`` (None when it does not constrain anything).
    ``vocab_size``: the model's (may exceed the tokenizer's); ``stop_token_ids``: EOS ids that end
    the JSON (default: the tokenizer's EOS)."""
    schema = json_schema_of(response_format)
    if schema is None:
        return None
    compiler = _compiler(tokenizer, vocab_size, stop_token_ids)
    try:
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError for bad schemas
        raise ValueError(f"response_format: the JSON schema cannot be compiled: {exc}") from None
    size = vocab_size or int(compiled.tokenizer_info.vocab_size)
    return Matcher(_xgr().GrammarMatcher(compiled), size)


def validate_response_format(tokenizer: Any, response_format: dict[str, Any] | None,
                             vocab_size: int | None = None) -> None:
    """Raise ValueError if ``response_format`` is malformed or its schema does not compile."""
    from_tokenizer(tokenizer, response_format, vocab_size=vocab_size)
