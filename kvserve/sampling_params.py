"""Per-request sampling settings, mirroring vLLM's ``SamplingParams``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SAMPLING_EPS = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS): no divide into inf
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SEED_STRIDE = 1_000_003  # sample i of a request draws with seed + SEED_STRIDE * i (runner/sampler.py)
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature`` below ``SAMPLING_EPS`` (1e-5) is greedy. ``top_k == 0``, ``top_p == 1`` and
    ``min_p == 0`` disable those filters. ``seed`` makes sampling reproducible per request (same
    seed, same prompt → same tokens, whatever else is in the batch); it must fit int64 for every
    sample (``seed + 1_000_003 * (n - 1)``). ``n`` samples share the prompt's KV blocks.

    Penalties and masks follow vLLM (kvserve/runner/logits_processors.py): ``repetition_penalty``
    (> 0, 1 = off) over prompt and output tokens; ``presence_penalty`` / ``frequency_penalty``
    ([-2, 2]) over output tokens; ``logit_bias`` (token id → bias in [-100, 100]) added to the
    logits; ``min_tokens`` masks EOS and ``stop_token_ids`` until that many tokens were generated;
    ``allowed_token_ids`` masks every other token; ``bad_words`` are never generated (their token
    ids, ``bad_words_token_ids``, are filled in by whoever holds the tokenizer).
    ``response_format``: OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema", ...}``
    (kvserve/runner/structured.py); ``None`` or ``{"type": "text"}`` is unconstrained.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    response_format: dict[str, Any] | None = field(default=None, hash=False)
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("stop", "bad_words"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, tuple):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if not isinstance(self.bad_words_token_ids, tuple):
            object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids))
        self._check_basics()
        self._check_penalties()
        self._check_masks()

    def _check_basics(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None:
            if not _is_int(self.seed):
                raise ValueError(f"seed must be an integer, got {self.seed!r}")
            last = self.seed + SEED_STRIDE * (self.n - 1)
            if not INT64_MIN <= self.seed <= INT64_MAX or last > INT64_MAX:
                raise ValueError(f"seed must fit int64 for every sample: [{INT64_MIN}, {INT64_MAX}] and "
                                 f"seed + {SEED_STRIDE} * (n - 1) <= {INT64_MAX}; got seed={self.seed}, "
                                 f"n={self.n}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0.0 < rp <= 100.0 or math.isinf(rp):
            raise ValueError(f"repetition_penalty must be in (0, 100] (1 disables it), got {rp!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be a mapping of token id to bias")
            for tid, bias in self.logit_bias.items():
                if not _is_int(tid) or tid < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {tid!r}")
                if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for {tid}")

    def _check_masks(self) -> None:
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (leave it unset for no restriction)")
            if any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be non-negative integers")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")
        if any(not w or any(not _is_int(t) or t < 0 for t in w) for w in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be non-empty sequences of token ids")
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type") if isinstance(rf, dict) else None
            if kind not in RESPONSE_FORMAT_TYPES:
                raise ValueError(f"response_format type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, "
                                 f"got {kind!r}")
            if kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
                    raise ValueError("response_format json_schema needs {'json_schema': {'schema': {...}}}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def structured(self) -> bool:
        """True when ``response_format`` constrains the output (json_object / json_schema)."""
        return self.response_format is not None and self.response_format.get("type") != "text"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)
