"""Multi-turn sessions: a conversation's KV stays pinned between turns.

A session owns the token ids of its whole history (prompts, replies, templated turn markers) and,
while it is *resident*, the block table holding the KV of ``token_ids[:num_computed]`` (the
last generated token is never computed, so ``num_computed == len(token_ids) - 1`` after a turn).
The next turn appends its new tokens and starts from those blocks: only the new tokens are
prefilled. History is never re-tokenized.

States::

    resident (blocks held) ──turn admitted──► running (blocks moved to the request's table)
        ▲                                               │ turn ends: blocks come back
        └───────────────────────────────────────────────┘
    ``busy`` is True from the moment a turn is queued until it ends: one turn at a time.
    resident ──idle timeout / memory pressure (LRU) / close──► released (no blocks; history kept
                                                               until close; next turn falls back
                                                               to the prefix cache, then recompute)

Plain Python; the pool's ref counts are taken and dropped by the manager.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Session:
    session_id: str
    token_ids: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)  # index in token_ids where each turn began
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    busy: bool = False
    last_used: float = 0.0
    created: float = 0.0

    @property
    def resident(self) -> bool:
        return bool(self.blocks)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SessionStats:
    active: int = 0
    expired: int = 0   # released by idle timeout
    evicted: int = 0   # released under memory pressure
    closed: int = 0


class SessionTable:
    """Sessions in least-recently-used order (the front is released first under pressure)."""

    def __init__(self, idle_timeout_s: float, clock: Callable[[], float]) -> None:
        if idle_timeout_s <= 0:
            raise ValueError(f"session idle timeout must be > 0 s, got {idle_timeout_s}")
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.stats = SessionStats()

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def get_or_create(self, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None:
            now = self.clock()
            s = Session(session_id, last_used=now, created=now)
            self._sessions[session_id] = s
        return s

    def touch(self, session: Session) -> None:
        session.last_used = self.clock()
        self._sessions.move_to_end(session.session_id)

    def remove(self, session_id: str) -> Session | None:
        return self._sessions.pop(session_id, None)

    def all(self) -> list[Session]:
        return list(self._sessions.values())

    def resident(self) -> list[Session]:
        """Sessions holding blocks, least recently used first. A turn that is running has moved
        its session's blocks into its own block table, so these hold no running request's KV."""
        return [s for s in self._sessions.values() if s.resident]

    def expired(self) -> list[Session]:
        """Resident sessions with no turn in flight whose idle timeout has passed."""
        deadline = self.clock() - self.idle_timeout_s
        return [s for s in self.resident() if not s.busy and s.last_used <= deadline]
