"""The router's index: block hash → the replicas that hold it and in which tiers.

Fed only by replicas' :class:`ReplicaPoll`s (their cache events, or a snapshot), never by the
router's own routing history, so it knows about evictions and about blocks that moved to a tier.
Plain Python: the router's unit and state-machine tests drive it directly.

Invariants:
  * for every replica, ``held(replica)`` equals what that replica's feed holds as of
    ``seq[replica]`` (events are applied in order; a gap raises :class:`IndexGap` and changes
    nothing, so the caller asks for a snapshot);
  * a dropped replica leaves no trace: no hash maps to it afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.cluster.records import TIER_ORDER, ReplicaEvent, ReplicaPoll


class IndexGap(LookupError):
    """A poll's events do not follow on from what the index has applied for that replica."""


class BlockIndex:
    def __init__(self) -> None:
        self._where: dict[bytes, dict[str, set[str]]] = {}
        self.seq: dict[str, int] = {}

    # -- updates -----------------------------------------------------------------------------
    def apply(self, replica: str, poll: ReplicaPoll) -> int:
        """Apply a replica's poll; returns how many events changed the index."""
        if poll.snapshot is not None:
            self.drop(replica)
            for tier, hashes in poll.snapshot.items():
                for h in hashes:
                    self._add(replica, tier, h)
            self.seq[replica] = poll.seq
            return sum(len(v) for v in poll.snapshot.values())
        have = self.seq.get(replica)
        if have is None:
            raise IndexGap(f"no snapshot of {replica} yet")
        fresh = [e for e in poll.events if e.seq > have]
        for i, e in enumerate(fresh):
            if e.seq != have + 1 + i:
                raise IndexGap(f"{replica}: event {e.seq} after {have + i}")
        for e in fresh:
            self._event(replica, e)
        self.seq[replica] = max(have, poll.seq)
        return len(fresh)

    def _event(self, replica: str, e: ReplicaEvent) -> None:
        if e.kind == "stored":
            self._add(replica, e.tier, e.block_hash)
        elif e.kind == "removed":
            tiers = self._where.get(e.block_hash, {}).get(replica)
            if tiers is not None:
                tiers.discard(e.tier)
                if not tiers:
                    self._forget(replica, e.block_hash)

    def _add(self, replica: str, tier: str, h: bytes) -> None:
        self._where.setdefault(h, {}).setdefault(replica, set()).add(tier)

    def _forget(self, replica: str, h: bytes) -> None:
        holders = self._where[h]
        del holders[replica]
        if not holders:
            del self._where[h]

    def drop(self, replica: str) -> None:
        """Forget everything about ``replica`` (it died, or a snapshot replaces its state)."""
        for h in [h for h, holders in self._where.items() if replica in holders]:
            self._forget(replica, h)
        self.seq.pop(replica, None)

    # -- queries -----------------------------------------------------------------------------
    def best_tier(self, replica: str, h: bytes) -> str | None:
        tiers = self._where.get(h, {}).get(replica)
        if not tiers:
            return None
        return min(tiers, key=TIER_ORDER.index)

    def prefix(self, replica: str, hashes: Sequence[bytes]) -> tuple[str, ...]:
        """The tiers of the longest prefix of ``hashes`` that ``replica`` holds (block by block)."""
        out: list[str] = []
        for h in hashes:
            tier = self.best_tier(replica, h)
            if tier is None:
                break
            out.append(tier)
        return tuple(out)

    def held(self, replica: str) -> dict[str, frozenset[bytes]]:
        """Tier → hashes this index believes ``replica`` holds."""
        out: dict[str, set[bytes]] = {}
        for h, holders in self._where.items():
            for tier in holders.get(replica, ()):
                out.setdefault(tier, set()).add(h)
        return {t: frozenset(s) for t, s in out.items()}

    def __len__(self) -> int:
        return len(self._where)
