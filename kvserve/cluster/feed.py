"""A replica's cache feed: its pool's and tiers' events turned into :class:`ReplicaEvent`s, logged.

Runs inside the replica (on its engine thread, as the pool's and the tier seam's subscriber).
Plain Python, no torch, no Ray: the router's tests drive it directly.

Invariants:
  * ``held()`` (tier → hashes) is exactly what replaying every event emitted so far gives;
  * an event is emitted only when ``held()`` changes (a second block with a hash already cached,
    or the removal of a block that no longer carries the hash, emits nothing), so the router
    never sees a removal that would hide a copy still there;
  * ``poll(since)`` returns the events after ``since`` in order, or a snapshot when some of them
    were dropped from the bounded log (or ``since`` is negative: "send me everything").
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from kvserve.cluster.records import TIER_ORDER, ReplicaEvent, ReplicaLoad, ReplicaPoll
from kvserve.kv.events import BlockRemoved, BlockStored, CacheEvent


class ReplicaFeed:
    def __init__(self, maxlen: int = 100_000) -> None:
        self._seq = 0
        self._log: deque[ReplicaEvent] = deque(maxlen=maxlen)
        self._held: dict[str, set[bytes]] = {t: set() for t in TIER_ORDER}
        self._pool_block: dict[bytes, int] = {}  # hash → the pool block that carries it
        self._lock = threading.Lock()  # the engine thread writes, the actor's loop polls

    # -- inputs ------------------------------------------------------------------------------
    def on_pool_event(self, event: CacheEvent) -> None:
        """A :class:`~kvserve.kv.block_pool.BlockPool` subscriber."""
        h = event.block_hash
        if isinstance(event, BlockStored):
            if h not in self._pool_block:
                self._pool_block[h] = event.block_id
                self._emit("stored", "pool", h)
        elif isinstance(event, BlockRemoved) and self._pool_block.get(h) == event.block_id:
            del self._pool_block[h]
            self._emit("removed", "pool", h)

    def on_tier_events(self, events: Iterable[object]) -> None:
        """A :class:`~kvserve.kv.tier_seam.TierSeam` subscriber (``TierEvent``s)."""
        for e in events:
            self.tier_change(e.kind, e.tier, e.key)  # type: ignore[attr-defined]

    def tier_change(self, kind: str, tier: str, key: bytes) -> None:
        held = self._held.get(tier)
        if held is None or tier == "pool":
            return
        if kind == "stored" and key not in held:
            held.add(key)
            self._emit("stored", tier, key)
        elif kind == "removed" and key in held:
            held.discard(key)
            self._emit("removed", tier, key)

    def _emit(self, kind: str, tier: str, key: bytes) -> None:
        with self._lock:
            self._seq += 1
            self._log.append(ReplicaEvent(self._seq, kind, tier, key))
            if kind == "stored":
                self._held[tier].add(key)
            else:
                self._held[tier].discard(key)

    # -- outputs -----------------------------------------------------------------------------
    @property
    def seq(self) -> int:
        return self._seq

    def held(self) -> dict[str, frozenset[bytes]]:
        with self._lock:
            return {t: frozenset(s) for t, s in self._held.items()}

    def poll(self, since: int, load: ReplicaLoad | None = None) -> ReplicaPoll:
        load = load or ReplicaLoad()
        with self._lock:
            oldest = self._log[0].seq if self._log else self._seq + 1
            if since < 0 or since + 1 < oldest:
                snap = {t: tuple(sorted(s)) for t, s in self._held.items() if s}
                return ReplicaPoll(self._seq, (), snap, load)
            return ReplicaPoll(self._seq, tuple(e for e in self._log if e.seq > since), None, load)

    def all_events(self) -> list[ReplicaEvent]:
        """The whole log (an offline replay's input)."""
        with self._lock:
            return list(self._log)
