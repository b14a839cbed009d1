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
    resident ──idle timeout / memory pressure (LRU) / close──► released (no blocks; history kept)
    released ──retention passed (idle) / tenant over its cap (its LRU idle session)──► forgotten

**One owner.** Only :class:`SessionTable` changes a :class:`Session`; the KV manager calls it (and
takes or drops the pool's references for the blocks it hands over), the engine and the server
only read. Plain Python, no torch. Lookups are O(1); expiry walks the LRU order from its oldest
end and stops at the first session still inside its deadline.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvserve.kv.session_store import SessionStore, record_of


@dataclass
class Session:
    session_id: str
    tenant: str | None = None
    token_ids: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)  # index in token_ids where each turn began
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    busy: bool = False
    cache_salt: str | None = None  # the salt of the turn whose KV ``blocks`` hold
    meta: dict[str, Any] = field(default_factory=dict)  # the front end's own record (a chat transcript), persisted
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
    expired: int = 0    # KV released by idle timeout
    evicted: int = 0    # KV released under memory pressure
    closed: int = 0
    forgotten: int = 0  # history dropped: retention passed, or the tenant's cap


class SessionTable:
    """Sessions in least-recently-used order (the front is released first under pressure)."""

    def __init__(self, idle_timeout_s: float, clock: Callable[[], float], retention_s: float | None = None,
                 max_per_tenant: int | None = None) -> None:
        if idle_timeout_s <= 0:
            raise ValueError(f"session idle timeout must be > 0 s, got {idle_timeout_s}")
        self.idle_timeout_s = idle_timeout_s
        self.retention_s = retention_s if retention_s is not None else idle_timeout_s + DEFAULT_GRACE_S
        if self.retention_s < idle_timeout_s:
            raise ValueError(f"session retention ({self.retention_s} s) must be >= the idle timeout ({idle_timeout_s} s)")
        self.max_per_tenant = max_per_tenant
        self.clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._per_tenant: dict[str | None, OrderedDict[str, None]] = {}
        self.stats = SessionStats()
        self.stores: list[SessionStore] = []  # where records persist (kvserve.kv.session_store)

    def restore(self, records: Iterable[dict[str, Any]]) -> int:
        """Recreate sessions from persisted records (no KV: their next turn loads it from the
        tiers). A session already known here wins. Returns how many were restored."""
        n = 0
        for r in records:
            sid = r["session_id"]
            if sid in self._sessions:
                continue
            now = self.clock()
            session = Session(sid, r.get("tenant"), list(r["token_ids"]), list(r["turn_starts"]),
                              cache_salt=r.get("cache_salt"), meta=dict(r.get("meta") or {}), last_used=now,
                              created=now)
            self._sessions[sid] = session
            self._per_tenant.setdefault(session.tenant, OrderedDict())[sid] = None
            n += 1
        return n

    def _persist(self, session: Session) -> None:
        for store in self.stores:
            store.save(record_of(session))

    # -- reading -----------------------------------------------------------------------------
    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def all(self) -> list[Session]:
        return list(self._sessions.values())

    def count(self, tenant: str | None) -> int:
        return len(self._per_tenant.get(tenant, ()))

    def resident(self) -> Iterator[Session]:
        """Sessions holding blocks, least recently used first. A turn that is running has moved
        its session's blocks into its own block table, so these hold no running request's KV."""
        return (s for s in self._sessions.values() if s.resident)

    def _idle_past(self, age_s: float) -> list[Session]:
        """Non-busy sessions unused for ``age_s``, oldest first (busy ones are skipped, not a stop)."""
        deadline = self.clock() - age_s
        out = []
        for s in self._sessions.values():
            if s.last_used > deadline:
                break
            if not s.busy:
                out.append(s)
        return out

    def expired(self, idle_s: float | None = None) -> list[Session]:
        """Resident sessions with no turn in flight idle for ``idle_s`` (default: the idle timeout)."""
        return [s for s in self._idle_past(self.idle_timeout_s if idle_s is None else idle_s) if s.resident]

    def past_retention(self) -> list[Session]:
        """Sessions whose history is to be forgotten (idle past the retention period)."""
        return self._idle_past(self.retention_s)

    # -- the one place sessions change --------------------------------------------------------
    def _touch(self, session: Session) -> None:
        session.last_used = self.clock()
        self._sessions.move_to_end(session.session_id)
        self._per_tenant[session.tenant].move_to_end(session.session_id)

    def begin_turn(self, session_id: str, turn_start: int, tenant: str | None = None) -> tuple[Session, list[Session]]:
        """Mark a session as serving a turn whose new tokens start at ``turn_start`` (creating it
        if new). Returns the session and the sessions forgotten to keep the tenant under its cap
        (their blocks are the caller's to free). One turn at a time: a busy session is a ValueError."""
        session = self._sessions.get(session_id)
        dropped: list[Session] = []
        if session is None:
            dropped = self._make_room(tenant)
            now = self.clock()
            session = Session(session_id, tenant, last_used=now, created=now)
            self._sessions[session_id] = session
            self._per_tenant.setdefault(tenant, OrderedDict())[session_id] = None
        elif session.busy:
            raise ValueError(f"session {session_id!r} is already serving a turn; wait for it to finish")
        session.busy = True
        session.turn_starts = [t for t in session.turn_starts if t < turn_start] + [turn_start]
        self._touch(session)
        return session, dropped

    def _make_room(self, tenant: str | None) -> list[Session]:
        cap = self.max_per_tenant
        if cap is None or self.count(tenant) < cap:
            return []
        idle = next((self._sessions[sid] for sid in self._per_tenant[tenant] if not self._sessions[sid].busy), None)
        if idle is None:
            raise ValueError(f"this tenant already has {cap} sessions, all serving a turn; close one or "
                             f"wait (max_sessions_per_tenant={cap})")
        self.remove(idle.session_id)
        self.stats.forgotten += 1
        return [idle]

    def end_turn(self, session: Session, blocks: list[int], num_computed: int, token_ids: list[int],
                 cache_salt: str | None) -> None:
        """A turn finished: the session parks the turn's blocks (the pool references move over)."""
        session.blocks, session.num_computed, session.busy = blocks, num_computed, False
        session.token_ids, session.cache_salt = token_ids, cache_salt
        self._touch(session)
        self._persist(session)

    def set_meta(self, session: Session, meta: dict[str, Any]) -> None:
        """Keep (and persist) the front end's record of the session, e.g. its chat transcript."""
        session.meta = meta
        self._persist(session)

    def abandon_turn(self, session: Session) -> None:
        """A turn ended without a reply to keep (aborted, failed): the history stays as it was."""
        session.busy = False
        self._touch(session)

    def take_blocks(self, session: Session) -> None:
        """The session's blocks moved to its running turn's block table (references with them)."""
        session.blocks, session.num_computed = [], 0

    def drop_blocks(self, session: Session) -> list[int]:
        """Release the session's KV; returns the blocks whose references the caller frees."""
        blocks, session.blocks, session.num_computed = session.blocks, [], 0
        return blocks

    def truncate_front(self, session: Session, cut: int) -> None:
        """Forget the history before token ``cut`` (a turn boundary); the session holds no KV then."""
        if session.blocks:
            raise RuntimeError("drop the session's blocks before truncating its history (positions shift)")
        session.token_ids = session.token_ids[cut:]
        session.turn_starts = [t - cut for t in session.turn_starts if t >= cut]

    def remove(self, session_id: str, keep_record: bool = False) -> Session | None:
        """Forget a session here (and in the stores, unless ``keep_record``: it moved elsewhere)."""
        session = self._sessions.pop(session_id, None)
        if session is not None:
            for store in self.stores if not keep_record else ():
                store.delete(session_id)
            per = self._per_tenant[session.tenant]
            per.pop(session_id, None)
            if not per:
                del self._per_tenant[session.tenant]
        return session


DEFAULT_GRACE_S = 1800.0  # history outlives KV by this much unless session_retention_s says otherwise
