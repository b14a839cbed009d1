"""Prices per million tokens, and what a request cost: the cache as an asset.

``input`` is charged for prompt tokens that were computed, ``cached_input`` for prompt tokens whose
KV was reused (pool or a tier), ``output`` for generated tokens; ``saved_by_cache`` is what the
cached tokens would have cost at the input price. With the prompt-caching API, computed tokens
written into a pinned prefix are charged ``cache_write`` (default: the input price) and reported
as ``cache_write``. Plain Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Prices:
    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0
    cache_write: float | None = None  # None: the input price

    def __post_init__(self) -> None:
        for name in ("input", "cached_input", "output", "cache_write"):
            v = getattr(self, name)
            if v is None and name == "cache_write":
                continue
            if not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
                raise ValueError(f"price_{name} must be a number >= 0 (per million tokens), got {v!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.input or self.cached_input or self.output)

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
             cache_write_tokens: int = 0) -> dict[str, float]:
        written = min(cache_write_tokens, prompt_tokens - cached_tokens)
        computed = prompt_tokens - cached_tokens - written
        parts = {"input": computed * self.input / 1e6, "cached_input": cached_tokens * self.cached_input / 1e6,
                 "output": completion_tokens * self.output / 1e6}
        if written > 0:
            price = self.input if self.cache_write is None else self.cache_write
            parts["cache_write"] = written * price / 1e6
        return {**{k: round(v, 9) for k, v in parts.items()}, "total": round(sum(parts.values()), 9),
                "saved_by_cache": round(cached_tokens * (self.input - self.cached_input) / 1e6, 9)}
