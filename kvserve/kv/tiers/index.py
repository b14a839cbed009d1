"""The scheduler side's view of the tiers: which block hashes each tier holds.

Fed only by :class:`~kvserve.kv.tiers.stack.TierEvent`s (and the tiers' snapshot at start-up), so
it knows about evictions and corrupt objects deleted below it. Plain Python, no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvserve.contract.records import TierEvent

TIER_ORDER = ("host", "disk", "remote")
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)  # seconds


@dataclass
class TierCounters:
    """What a tier did, as the scheduler side saw it (tier events, lookups and load results).

    A lookup below the pool probes the tiers in order for each block of the prefix: the first
    tier holding it counts a hit, every faster tier a miss; the block that ends the lookup (no
    tier holds it) is a miss in every tier. ``load_buckets[i]`` counts loads that took at most
    ``LOAD_BUCKETS[i]`` seconds (and more than the bucket before); the last slot counts the rest."""

    bytes: int = 0
    saves: int = 0
    removed: int = 0
    hits: int = 0
    misses: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    load_buckets: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))
    checksum_failures: int = 0
    up: bool = True

    def observe_load(self, seconds: float) -> None:
        self.loads += 1
        self.load_seconds += seconds
        self.load_buckets[bisect.bisect_left(LOAD_BUCKETS, seconds)] += 1


class TierIndex:
    def __init__(self, tiers: Iterable[str] = ()) -> None:
        self.tiers = [t for t in TIER_ORDER if t in set(tiers)]
        self._held: dict[str, set[bytes]] = {t: set() for t in self.tiers}
        self._sizes: dict[tuple[str, bytes], int] = {}
        self.counters: dict[str, TierCounters] = {t: TierCounters() for t in self.tiers}

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def apply(self, events: Iterable[object]) -> None:
        for e in events:
            tier, kind, key = e.tier, e.kind, e.key  # type: ignore[attr-defined]
            held, c = self._held.get(tier), self.counters.get(tier)
            if held is None or c is None:
                continue
            if kind == "stored":
                held.add(key)
                c.saves += 1
                c.bytes += e.size - self._sizes.get((tier, key), 0)  # type: ignore[attr-defined]
                self._sizes[(tier, key)] = e.size  # type: ignore[attr-defined]
                c.up = True
            elif kind == "removed":
                held.discard(key)
                c.removed += 1
                c.bytes -= self._sizes.pop((tier, key), 0)
            elif kind == "corrupt":
                c.checksum_failures += 1
            elif kind in ("down", "up"):
                c.up = kind == "up"

    def load_snapshot(self, snapshot: dict[str, list[tuple[bytes, int]]]) -> None:
        """What the tiers held at start-up (the disk tier's index rebuilt from its directory)."""
        self.apply(TierEvent("stored", tier, key, size) for tier, items in snapshot.items() for key, size in items)
        for c in self.counters.values():
            c.saves = 0  # not saves of this run

    def mark(self, tier: str, keys: Iterable[bytes]) -> None:
        """Believe ``tier`` holds ``keys`` (a remote tier this process cannot list)."""
        self._held[tier].update(keys)

    def probe(self, key: bytes) -> str | None:
        """:meth:`best`, counted as a lookup: a hit in the tier found, a miss in each one above
        it (in every tier when none holds ``key``)."""
        tier = self.best(key)
        for t in self.tiers:
            if t == tier:
                self.counters[t].hits += 1
                break
            self.counters[t].misses += 1
        return tier

    def best(self, key: bytes) -> str | None:
        """The fastest tier holding ``key``."""
        return next((t for t in self.tiers if key in self._held[t]), None)

    def held(self, tier: str) -> frozenset[bytes]:
        """The block hashes ``tier`` holds, as far as this index knows."""
        return frozenset(self._held.get(tier, ()))

    def count(self, tier: str) -> int:
        return len(self._held.get(tier, ()))
