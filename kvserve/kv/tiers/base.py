"""What every tier is: a bounded map from block hash to block object, with its own eviction.

Invariants: ``nbytes == sum of held objects' sizes <= capacity_bytes`` after every ``put``;
``put`` evicts least recently used objects first (the eviction policy's order) and reports them;
a failed tier (``up == False``) answers every ``get`` with None and every ``put`` with no change,
so the caller degrades to the tiers above it and nothing fails because a tier did.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from kvserve.kv.eviction import make_policy


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    saves: int = 0
    loads: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    errors: int = 0
    load_seconds: float = 0.0  # summed; the scheduler side's per-tier counters are what /metrics reads


class Tier(Protocol):
    name: str
    capacity_bytes: int
    stats: TierStats

    @property
    def up(self) -> bool: ...

    @property
    def nbytes(self) -> int: ...

    def put(self, key: bytes, data: bytes) -> list[bytes]:
        """Store ``data`` under ``key``; returns the keys evicted to make room (and ``key``
        itself if it could not be stored)."""
        ...

    def get(self, key: bytes) -> bytes | None:
        """``read`` then ``note_read``."""
        ...

    def read(self, key: bytes) -> bytes | None:
        """The object's bytes, or None: the I/O only, safe beside the tier's other operations
        (the caller serialises the bookkeeping, not the read)."""
        ...

    def note_read(self, key: bytes, data: bytes | None) -> None:
        """The bookkeeping of a ``read``: hit/miss counts, recency; a key whose object vanished
        is forgotten."""
        ...

    def delete(self, key: bytes) -> None: ...

    def keys(self) -> Iterable[bytes]: ...


class LocalTier:
    """The bookkeeping shared by tiers whose index lives in this process (host, disk): sizes,
    the LRU order through the eviction-policy seam, and capacity enforcement."""

    name = "local"
    spill: dict[bytes, bytes] | None = None  # write-back: objects evicted, for the next tier down

    def __init__(self, capacity_bytes: int, eviction: str = "lru") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"a KV tier needs a capacity > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._sizes: dict[bytes, int] = {}
        self._order = make_policy(eviction, [])
        self._nbytes = 0
        self.stats = TierStats()

    @property
    def up(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> Iterable[bytes]:
        return list(self._sizes)

    def sized_keys(self) -> list[tuple[bytes, int]]:
        return list(self._sizes.items())

    def _index(self, key: bytes, size: int) -> list[bytes]:
        """Record ``key`` (``size`` bytes) and evict until within capacity; returns evicted keys."""
        if key in self._sizes:
            self._forget(key)
        evicted: list[bytes] = []
        if size > self.capacity_bytes:
            return [key]
        while self._nbytes + size > self.capacity_bytes:
            victim = self._order.pop()  # type: ignore[assignment]
            evicted.append(victim)  # type: ignore[arg-type]
            self._nbytes -= self._sizes.pop(victim)  # type: ignore[call-overload]
            self._drop_bytes(victim)  # type: ignore[arg-type]
            self.stats.evictions += 1
        self._sizes[key] = size
        self._nbytes += size
        self._order.push(key)  # type: ignore[arg-type]
        return evicted

    def _forget(self, key: bytes) -> None:
        self._nbytes -= self._sizes.pop(key)
        self._order.remove(key)  # type: ignore[arg-type]

    def _touch(self, key: bytes) -> None:
        self._order.touch(key)  # type: ignore[arg-type]

    def get(self, key: bytes) -> bytes | None:
        data = self.read(key)
        self.note_read(key, data)
        return data

    def read(self, key: bytes) -> bytes | None:
        raise NotImplementedError

    def note_read(self, key: bytes, data: bytes | None) -> None:
        if data is None:
            self.stats.misses += 1
            if key in self._sizes:  # indexed, but its object could not be read: gone
                self._forget(key)
            return
        self.stats.hits += 1
        if key in self._sizes:
            self._touch(key)

    def delete(self, key: bytes) -> None:
        """Remove ``key`` for good (a corrupt object: never handed to the next tier)."""
        if key in self._sizes:
            self._forget(key)
            saved, self.spill = self.spill, None
            self._drop_bytes(key)
            self.spill = saved

    def _drop_bytes(self, key: bytes) -> None:
        raise NotImplementedError

    def check(self) -> None:
        assert self._nbytes == sum(self._sizes.values()) <= self.capacity_bytes, "tier bytes out of sync"
        assert len(self._order) == len(self._sizes) and all(k in self._order for k in self._sizes), "LRU out of sync"
