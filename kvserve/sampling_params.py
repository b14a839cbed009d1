"""Per-request sampling settings, mirroring vLLM's ``SamplingParams``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes sampling reproducible per request (same seed, same prompt → same tokens,
    whatever else is in the batch). ``n`` samples share the prompt's KV blocks.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)
