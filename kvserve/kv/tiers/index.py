"""The scheduler side's view of the tiers: which block hashes each tier holds.

Fed only by :class:`~kvserve.kv.tiers.stack.TierEvent`s (and the tiers' snapshot at start-up), so
it knows about evictions and corrupt objects deleted below it. Plain Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable

TIER_ORDER = ("host", "disk", "remote")


class TierIndex:
    def __init__(self, tiers: Iterable[str] = ()) -> None:
        self.tiers = [t for t in TIER_ORDER if t in set(tiers)]
        self._held: dict[str, set[bytes]] = {t: set() for t in self.tiers}

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def apply(self, events: Iterable[object]) -> None:
        for e in events:
            held = self._held.get(e.tier)  # type: ignore[attr-defined]
            if held is None:
                continue
            if e.kind == "stored":  # type: ignore[attr-defined]
                held.add(e.key)  # type: ignore[attr-defined]
            else:
                held.discard(e.key)  # type: ignore[attr-defined]

    def load_snapshot(self, snapshot: dict[str, list[bytes]]) -> None:
        for tier, keys in snapshot.items():
            if tier in self._held:
                self._held[tier].update(keys)

    def mark(self, tier: str, keys: Iterable[bytes]) -> None:
        """Believe ``tier`` holds ``keys`` (a remote tier this process cannot list)."""
        self._held[tier].update(keys)

    def best(self, key: bytes) -> str | None:
        """The fastest tier holding ``key``."""
        return next((t for t in self.tiers if key in self._held[t]), None)

    def count(self, tier: str) -> int:
        return len(self._held.get(tier, ()))
