"""The scheduler side's view of the tiers: which block hashes each tier holds.

Fed only by :class:`~kvserve.kv.tiers.stack.TierEvent`s (and the tiers' snapshot at start-up), so
it knows about evictions and corrupt objects deleted below it. Plain Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.contract.records import TierEvent

TIER_ORDER = ("host", "disk", "remote")


@dataclass
class TierCounters:
    """What a tier did, as the scheduler side saw it (tier events and load results)."""

    bytes: int = 0
    saves: int = 0
    removed: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    checksum_failures: int = 0
    up: bool = True


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

    def best(self, key: bytes) -> str | None:
        """The fastest tier holding ``key``."""
        return next((t for t in self.tiers if key in self._held[t]), None)

    def held(self, tier: str) -> frozenset[bytes]:
        """The block hashes ``tier`` holds, as far as this index knows."""
        return frozenset(self._held.get(tier, ()))

    def count(self, tier: str) -> int:
        return len(self._held.get(tier, ()))
