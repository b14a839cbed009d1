"""The HTTP server's own settings (the engine's are in :mod:`kvserve.config`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import SESSION_OVERFLOW
from kvserve.pricing import Prices

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class ServerConfig:
    """``max_waiting``: a request whose sequences (``n`` × prompts) would take the waiting queue
    past this many gets 429 with ``Retry-After`` (``None``: no limit).

    Identity: ``api_keys`` maps each accepted key to its tenant; ``api_key`` (one key, tenant
    ``default``) is the short form. No key at all: single-tenant, ``/v1/*`` is open. Each tenant
    sees only its own sessions; its tenant name is part of the prefix-cache salt unless
    ``share_prefix_cache_across_tenants``.

    Input bounds (a request over one gets a 400 naming it): ``max_n`` samples; ``max_stop``
    stop strings of at most ``max_stop_chars`` characters; ``max_stop_token_ids``;
    ``max_logit_bias`` entries; ``max_bad_words``; ``max_body_bytes`` per request body (413).
    ``tokenizer_workers``: threads that tokenize, off the event loop and the engine thread.
    ``session_overflow``: the default for requests that give none (``None``: the engine's).
    ``sample_interval_s`` / ``dashboard_points``: the dashboard's time series."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_keys: dict[str, str] = field(default_factory=dict)
    share_prefix_cache_across_tenants: bool = False
    served_model_name: str = "kvserve"
    max_waiting: int | None = 256
    retry_after_s: int = 1
    max_n: int = 128
    max_stop: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 300
    max_bad_words: int = 64
    max_body_bytes: int = 4 * 2**20
    tokenizer_workers: int = 2
    session_overflow: str | None = None
    sample_interval_s: float = 1.0
    dashboard_points: int = 300
    prices: Prices = field(default_factory=Prices)  # per million tokens: usage.cost, kvserve:cost_total

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must be a non-empty string or None")
        for key, tenant in self.api_keys.items():
            if not key.strip() or not tenant.strip() or "\x1f" in tenant:
                raise ValueError("api_keys: every key and tenant name must be non-empty (no \\x1f)")
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {self.max_waiting}")
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s must be >= 1, got {self.retry_after_s}")
        for name in ("max_n", "max_stop", "max_stop_chars", "max_stop_token_ids", "max_logit_bias",
                     "max_bad_words", "max_body_bytes", "tokenizer_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.session_overflow not in (None, *SESSION_OVERFLOW):
            raise ValueError(f"session_overflow must be one of {', '.join(SESSION_OVERFLOW)}, "
                             f"got {self.session_overflow!r}")
        if self.sample_interval_s <= 0:
            raise ValueError(f"sample_interval_s must be > 0, got {self.sample_interval_s}")
        if self.dashboard_points < 2:
            raise ValueError(f"dashboard_points must be >= 2, got {self.dashboard_points}")

    @property
    def keys(self) -> dict[str, str]:
        """Every accepted key → its tenant (empty: no authentication, single tenant)."""
        out = dict(self.api_keys)
        if self.api_key is not None:
            out.setdefault(self.api_key, DEFAULT_TENANT)
        return out
