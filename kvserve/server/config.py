"""The HTTP server's own settings (the engine's are in :mod:`kvserve.config`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """``max_waiting``: a request that finds this many requests already waiting gets 429 with
    ``Retry-After`` (``None``: no limit). ``api_key``: ``/v1/*`` needs ``Authorization: Bearer
    <key>``. ``sample_interval_s`` / ``dashboard_points``: the dashboard's time series (one point
    per interval, the newest ``dashboard_points`` kept)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str = "kvserve"
    max_waiting: int | None = 256
    retry_after_s: int = 1
    sample_interval_s: float = 1.0
    dashboard_points: int = 300

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must be a non-empty string or None")
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {self.max_waiting}")
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s must be >= 1, got {self.retry_after_s}")
        if self.sample_interval_s <= 0:
            raise ValueError(f"sample_interval_s must be > 0, got {self.sample_interval_s}")
        if self.dashboard_points < 2:
            raise ValueError(f"dashboard_points must be >= 2, got {self.dashboard_points}")
