"""Cache events: the truth about where KV is, for tiers, routers and tests to follow.

The block pool emits, in order:

* ``BlockStored(hash, block_id, tier)`` when a full block becomes findable by its hash;
* ``BlockRemoved(hash, block_id, tier)`` when it stops being findable (its block was reused, or
  the cache was reset);
* ``BlockTouched(hash, block_id, tier)`` when a findable block gains a holder (a prefix hit).

Every event carries a sequence number from one counter; an :class:`EventLog` keeps the most
recent ones, so a subscriber that missed some (a restarted router) takes a snapshot of the hash
map plus the events after the snapshot's number, and :func:`replay` rebuilds the map exactly.
Plain data, no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvserve.kv.hashing import BlockHash


@dataclass(frozen=True)
class _BlockEvent:
    seq: int
    block_hash: BlockHash
    block_id: int
    tier: str = "pool"


@dataclass(frozen=True)
class BlockStored(_BlockEvent):
    """The block became findable by its hash in ``tier``."""


@dataclass(frozen=True)
class BlockRemoved(_BlockEvent):
    """The block stopped being findable (reused for other tokens, or the cache was reset)."""


@dataclass(frozen=True)
class BlockTouched(_BlockEvent):
    """A findable block gained a holder (a prefix hit)."""


CacheEvent = BlockStored | BlockRemoved | BlockTouched
Subscriber = Callable[[CacheEvent], None]


class EventLog:
    """The last ``maxlen`` events in order (all of them when ``maxlen`` is None)."""

    def __init__(self, maxlen: int | None = 100_000) -> None:
        self._events: deque[CacheEvent] = deque(maxlen=maxlen)

    def __call__(self, event: CacheEvent) -> None:
        self._events.append(event)

    def __len__(self) -> int:
        return len(self._events)

    def since(self, seq: int) -> list[CacheEvent]:
        """Events with a sequence number above ``seq``. Raises LookupError when some of them
        have already been dropped (the caller needs a fresh snapshot)."""
        if self._events and seq + 1 < self._events[0].seq:
            raise LookupError(f"events after {seq} are no longer all held (oldest is {self._events[0].seq})")
        return [e for e in self._events if e.seq > seq]

    def all(self) -> list[CacheEvent]:
        return list(self._events)


def replay(events: Iterable[CacheEvent], start: dict[BlockHash, int] | None = None) -> dict[BlockHash, int]:
    """The hash → block map after ``events``, from ``start`` (a snapshot) or empty."""
    index = dict(start or {})
    for e in events:
        if isinstance(e, BlockStored):
            index[e.block_hash] = e.block_id
        elif isinstance(e, BlockRemoved) and index.get(e.block_hash) == e.block_id:
            del index[e.block_hash]
    return index
