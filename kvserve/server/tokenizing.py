"""Tokenization off the event loop and off the engine thread, and the byte-length bound.

``TokenizerPool`` runs tokenizer work (chat templates, encoding) on a few worker threads, each
with its own copy of the tokenizer (a Rust tokenizer object must not be used by two threads at
once; the engine thread keeps the original for detokenizing). The tokenizers library releases
the GIL while it encodes, so a 10 MB prompt no longer stalls other clients.

The byte-length bound rejects a prompt over ``max_model_len`` before tokenizing it, but only
when its bytes *prove* it. Every token covers at least one byte, so ``len(bytes)`` is an upper
bound on the token count: useless for rejecting. The safe bound is the other one: no token
covers more than ``B`` bytes (the longest vocabulary entry, special tokens included), so a text
of ``N`` bytes has at least ``ceil(N / B)`` tokens. That holds only when encoding maps every
byte of the text to some token without dropping or shrinking any: a byte-level BPE tokenizer
(GPT-2, Llama 3, Qwen, the shipped model) with no normalizer. For other tokenizers (a
normalizer such as NFKC can turn 3 bytes into 1; an unknown token can swallow a whole word)
``max_token_bytes`` is None and nothing is rejected early. Chat templates only add text around
the messages, and the bound is applied to the rendered text, so it holds there too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def max_token_bytes(tokenizer: Any) -> int | None:
    """The most bytes one token can cover, or None when no such bound is provable."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    if type(backend.decoder).__name__ != "ByteLevel" or type(backend.pre_tokenizer).__name__ != "ByteLevel":
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    longest = max((len(tok) for tok in vocab), default=1)  # byte-level: one character per byte
    added = [len(str(t).encode()) for t in getattr(tokenizer, "get_added_vocab", dict)()]
    return max([longest, *added])


def min_tokens_of(text: str, bound: int | None) -> int:
    """A lower bound on the tokens ``text`` encodes to (0 when none is provable)."""
    if bound is None or not text:
        return 0
    n = len(text.encode("utf-8", errors="surrogatepass"))
    return -(-n // bound)


class TokenizerPool:
    """Runs ``fn(tokenizer)`` on a worker thread with that thread's own tokenizer copy."""

    def __init__(self, tokenizer: Any, workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.max_token_bytes = max_token_bytes(tokenizer)
        self._local = threading.local()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvserve-tokenize")

    def _mine(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = copy.deepcopy(self.tokenizer)
            self._local.tokenizer = tok
        return tok

    async def run(self, fn: Callable[[Any], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(self._mine()))

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self.run(lambda tok: list(tok.encode(text, add_special_tokens=add_special_tokens)))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
