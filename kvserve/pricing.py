"""Prices per million tokens, and what a request cost: the cache as an asset.

``input`` is charged for prompt tokens that were computed, ``cached_input`` for prompt tokens whose
KV was reused (pool or a tier), ``output`` for generated tokens; ``saved_by_cache`` is what the
cached tokens would have cost at the input price. Plain Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Prices:
    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0

    def __post_init__(self) -> None:
        for name in ("input", "cached_input", "output"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
                raise ValueError(f"price_{name} must be a number >= 0 (per million tokens), got {v!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.input or self.cached_input or self.output)

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, float]:
        computed = prompt_tokens - cached_tokens
        parts = {"input": computed * self.input / 1e6, "cached_input": cached_tokens * self.cached_input / 1e6,
                 "output": completion_tokens * self.output / 1e6}
        return {**{k: round(v, 9) for k, v in parts.items()}, "total": round(sum(parts.values()), 9),
                "saved_by_cache": round(cached_tokens * (self.input - self.cached_input) / 1e6, 9)}
