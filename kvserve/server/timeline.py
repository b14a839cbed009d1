"""The dashboard's time series: one point per sampling interval, the newest N kept.

Latencies are gathered from engine events (an :class:`EngineListener`) between samples; a point
carries the p50/p95 of the TTFTs and inter-token gaps seen in its interval (``None`` when there
were none, so charts show a gap, not a fake zero). KV and queue figures come from an
:class:`EngineSnapshot` taken at sampling time.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any

from kvserve.engine.async_engine import EngineSnapshot, FinishedRequest
from kvserve.server.metrics import SOURCES, sources_of


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


class Timeline:
    def __init__(self, max_points: int = 300) -> None:
        self.points: deque[dict[str, Any]] = deque(maxlen=max_points)
        self._lock = threading.Lock()
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._tokens = 0
        self._finished = 0
        self._sources: dict[str, int] = {}
        self._last: tuple[float, EngineSnapshot] | None = None

    # -- EngineListener (engine thread) ------------------------------------------------------
    def on_first_token(self, ttft_s: float, now: float) -> None:
        with self._lock:
            self._ttft.append(ttft_s)
            self._tokens += 1

    def on_token_gaps(self, gaps_s: list[float], now: float) -> None:
        with self._lock:
            self._itl.extend(gaps_s)
            self._tokens += len(gaps_s)

    def on_finished(self, req: FinishedRequest, now: float) -> None:
        with self._lock:
            self._finished += 1
            for source, n in sources_of(req).items():
                self._sources[source] = self._sources.get(source, 0) + n

    # -- sampling (event loop) ---------------------------------------------------------------
    def sample(self, snap: EngineSnapshot, now: float | None = None, wall: float | None = None) -> dict[str, Any]:
        """Close the current interval: one point from ``snap`` and the events since the last one."""
        now = time.monotonic() if now is None else now
        with self._lock:
            ttft, itl, tokens, finished = self._ttft, self._itl, self._tokens, self._finished
            self._ttft, self._itl, self._tokens, self._finished = [], [], 0, 0
            sources, self._sources = self._sources, {}
        dt = now - self._last[0] if self._last else None
        prev = self._last[1] if self._last else None
        dq = snap.prefix_queries - (prev.prefix_queries if prev else 0)
        dh = snap.prefix_hits - (prev.prefix_hits if prev else 0)
        point = {
            "t": time.time() if wall is None else wall,
            "kv_usage": snap.kv_usage_ratio, "fragmentation": snap.fragmentation_ratio,
            "blocks_used": snap.blocks_used, "blocks_pinned": snap.blocks_pinned,
            "blocks_cached_free": snap.blocks_cached_free, "tokens_held": snap.tokens_held,
            "seq_len_avg": snap.seq_len_avg, "seq_len_max": snap.seq_len_max,
            "hit_rate": snap.prefix_hit_rate, "hit_rate_interval": dh / dq if dq > 0 else None,
            "sessions_active": snap.sessions_active, "running": snap.num_running, "waiting": snap.num_waiting,
            "preemptions": snap.num_preemptions,
            "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
            "itl_p50": percentile(itl, 50), "itl_p95": percentile(itl, 95),
            "tokens_per_s": tokens / dt if dt else None, "requests_per_s": finished / dt if dt else None,
            # where this interval's finished prompts' KV came from, and what each tier holds
            **{f"src_{s}": sources.get(s, 0) for s in SOURCES},
            **{f"tier_{t}_blocks": st["blocks"] for t, st in snap.tiers.items()},
        }
        self._last = (now, snap)
        self.points.append(point)
        return point

    def data(self, info: dict[str, Any]) -> dict[str, Any]:
        return {"info": info, "points": list(self.points)}
