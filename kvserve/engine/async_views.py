"""What the engine thread reports out of the engine: per-request figures, KV snapshots, sessions.

Everything here that takes an :class:`LLMEngine` must run on the engine thread
(:class:`kvserve.engine.async_engine.AsyncLLMEngine` calls it through a command).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.engine.engine import LLMEngine

SESSION_SEP = "\x1f"  # the server namespaces session ids as "tenant\x1fid"


class SessionChangedError(ValueError):
    """A session turn was planned against a session state that changed before it was added."""


@dataclass(frozen=True)
class FinishedRequest:
    """Per-request figures, reported once when a request ends (aborted ones included)."""

    request_id: str
    finish_reason: str | None
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int
    queue_s: float | None   # arrival → first scheduled
    ttft_s: float | None    # arrival → first token
    e2e_s: float            # arrival → end
    kv_gib_s: float         # ∫ KV bytes held by the request dt, in GiB·s
    kv_hit_tokens: dict[str, int] = field(default_factory=dict)  # prompt tokens reused per place (pool, host …)
    cache_write_tokens: int = 0  # prompt tokens written to a pinned prefix (prompt caching)
    kv_miss_tokens: dict[str, int] = field(default_factory=dict)  # prompt tokens recomputed, by reason


class EngineListener(Protocol):
    def on_first_token(self, ttft_s: float, now: float) -> None: ...
    def on_token_gaps(self, gaps_s: list[float], now: float) -> None: ...
    def on_finished(self, req: FinishedRequest, now: float) -> None: ...


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's KV and queue state at one moment (taken on the engine thread)."""

    num_running: int
    num_waiting: int
    blocks_total: int
    blocks_used: int
    blocks_cached_free: int
    blocks_pinned: int
    block_size: int
    tokens_held: int
    slots_in_used_blocks: int
    seq_len_avg: float
    seq_len_max: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    sessions_active: int
    sessions_expired: int
    sessions_evicted: int
    kv_bytes_per_token: int
    token_capacity: int
    max_model_len: int
    tiers: dict[str, dict[str, Any]] = field(default_factory=dict)  # per KV tier: blocks, bytes, saves …
    # the prompt-caching API's pins (kvserve.kv.prefix_pins)
    prompt_cache_pins: int = 0
    prompt_cache_pinned_blocks: int = 0
    prompt_cache_pins_created: int = 0
    prompt_cache_pins_refreshed: int = 0
    prompt_cache_pins_expired: int = 0
    prompt_cache_pins_evicted: int = 0
    spec_verifies: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def kv_usage_ratio(self) -> float:
        return self.blocks_used / self.blocks_total

    @property
    def fragmentation_ratio(self) -> float:
        """1 − tokens held ÷ slots in used blocks (0 when nothing is held)."""
        return 1.0 - self.tokens_held / self.slots_in_used_blocks if self.slots_in_used_blocks else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted ÷ proposed draft tokens (0 before any draft)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


def take_snapshot(engine: LLMEngine) -> EngineSnapshot:
    """Read the engine's state. Call on the engine thread only."""
    st = engine.stats()
    running = engine.scheduler.running
    lens = [r.num_tokens for r in running]
    held = engine.kv.tokens_held({r.request_id: r.num_computed_tokens for r in running})
    cap = engine.capacity
    return EngineSnapshot(
        num_running=st.num_running, num_waiting=st.num_waiting, blocks_total=st.blocks_total,
        blocks_used=st.blocks_used, blocks_cached_free=st.blocks_cached_free,
        blocks_pinned=st.blocks_pinned, block_size=cap.block_size, tokens_held=held,
        slots_in_used_blocks=st.blocks_used * cap.block_size,
        seq_len_avg=sum(lens) / len(lens) if lens else 0.0, seq_len_max=max(lens, default=0),
        prefix_queries=st.prefix_queries, prefix_hits=st.prefix_hits, num_preemptions=st.num_preemptions,
        sessions_active=st.sessions_active, sessions_expired=st.sessions_expired,
        sessions_evicted=st.sessions_evicted, kv_bytes_per_token=cap.bytes_per_token,
        token_capacity=cap.token_capacity, max_model_len=engine.max_model_len,
        tiers=tier_stats(engine), **pin_stats(engine), spec_verifies=st.spec_verifies,
        spec_draft_tokens=st.spec_draft_tokens, spec_accepted_tokens=st.spec_accepted_tokens,
    )


def pin_stats(engine: LLMEngine) -> dict[str, int]:
    pins = engine.kv.pins
    return {"prompt_cache_pins": len(pins), "prompt_cache_pinned_blocks": pins.held_refs(),
            "prompt_cache_pins_created": pins.stats.created, "prompt_cache_pins_refreshed": pins.stats.refreshed,
            "prompt_cache_pins_expired": pins.stats.expired, "prompt_cache_pins_evicted": pins.stats.evicted}


def tier_stats(engine: LLMEngine) -> dict[str, dict[str, Any]]:
    """Per configured KV tier: blocks and bytes held, saves, lookups' hits and misses, loads, load
    time (and its histogram, ``load_buckets``), checksum failures, up."""
    index = engine.kv.tiers.index
    out: dict[str, dict[str, Any]] = {}
    for tier in index.tiers:
        c = index.counters[tier]
        out[tier] = {"blocks": index.count(tier), "bytes": c.bytes, "saves": c.saves, "removed": c.removed,
                     "hits": c.hits, "misses": c.misses, "loads": c.loads, "load_seconds": c.load_seconds,
                     "load_buckets": list(c.load_buckets), "checksum_failures": c.checksum_failures,
                     "up": 1.0 if c.up else 0.0}
    return out


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    num_tokens: int
    resident: bool      # holds its KV blocks now (False once released: idle, memory pressure)
    pinned_blocks: int
    busy: bool          # a turn is in flight
    idle_s: float       # seconds since its last turn
    meta: dict[str, Any] | None = None  # the front end's persisted record (a chat transcript)


def _info(s: Any, now: float) -> SessionInfo:
    return SessionInfo(s.session_id, s.num_tokens, s.resident, len(s.blocks), s.busy, max(0.0, now - s.last_used),
                       s.meta or None)


def session_infos(engine: LLMEngine, now: float | None = None, prefix: str | None = None) -> list[SessionInfo]:
    """Every session the engine knows (those whose id starts with ``prefix``). Engine thread only."""
    now = time.monotonic() if now is None else now
    return [_info(s, now) for s in engine.list_sessions() if prefix is None or s.session_id.startswith(prefix)]


def session_info(engine: LLMEngine, session_id: str) -> SessionInfo | None:
    """One session by id (a dict lookup), or None. Engine thread only."""
    s = engine.kv.sessions.get(session_id)
    return None if s is None else _info(s, time.monotonic())


def _start_session_turn(engine: LLMEngine, session_id: str, restart: bool, expect_tokens: int | None) -> None:
    """Checks made on the engine thread right before a session turn is added: the session is as
    the caller planned (``expect_tokens``: its length, None = absent), and ``restart`` closes it
    (history and KV) so the turn starts it afresh. Raises ValueError (nothing changed)."""
    s = engine.kv.sessions.get(session_id)
    if s is not None and s.busy:
        raise ValueError(f"session {session_id.split(SESSION_SEP)[-1]!r} is already serving a turn; "
                         "wait for it to finish")
    if not restart and (None if s is None else s.num_tokens) != expect_tokens:
        raise SessionChangedError("the session changed while this turn was prepared; retry")
    if restart and s is not None:
        engine.close_session(session_id)
