"""The tiers below one pool, in order (host, disk, remote), driven by ``SaveBlock``/``LoadBlock``.

Runs beside the KV storage. ``save`` writes a block's object to every tier (write-through: a
block that reached the pool's prefix cache is on disk before the next step runs, so ``kill -9``
loses at most the last step's blocks); ``load`` reads the first tier that has it, verifies the
object, and on a checksum or root-key failure deletes it there, counts it and tries the next tier.
Every change of what a tier holds is returned as a :class:`TierEvent` for the scheduler's index.

Thread-safe: loads run on the runner's loader thread (``kvserve.runner.tier_loader``) while saves
run on the step's thread. One lock serialises the bookkeeping (indexes, recency, health); a load's
read (a file, a Redis round trip) and its checksum run outside it, so a slow or stuck read never
holds up a save, and so never the step.
"""

from __future__ import annotations

import logging
import threading
import time

from kvserve.contract.block_ops import BlockPayload
from kvserve.contract.records import TierEvent
from kvserve.kv.tiers import object_format
from kvserve.kv.tiers.base import Tier

log = logging.getLogger("kvserve")


class TierStack:
    def __init__(self, tiers: list[Tier], root: bytes, write: str = "through") -> None:
        if write not in ("through", "back"):
            raise ValueError(f"tier write policy must be through or back, got {write!r}")
        self.tiers = tiers
        self.root = root
        self.write = write
        for tier in tiers[:-1]:  # write-back: what a tier evicts goes down to the next one
            if write == "back" and hasattr(tier, "spill"):
                tier.spill = {}
        self._up = {t.name: True for t in tiers}
        self._lock = threading.Lock()

    def _health(self, tier: Tier, events: list[TierEvent]) -> bool:
        """Whether ``tier`` is up now; a change since last seen becomes an "up"/"down" event."""
        up = tier.up
        if up != self._up[tier.name]:
            self._up[tier.name] = up
            events.append(TierEvent("up" if up else "down", tier.name))
        return up

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def save(self, key: bytes, parent: bytes, payload: BlockPayload) -> list[TierEvent]:
        """Write-through: the object goes to every tier. Write-back: to the first tier only, and
        what a tier evicts to make room goes down to the next (host → disk → remote)."""
        data = object_format.encode(payload, root=self.root, block_hash=key, parent=parent)
        events: list[TierEvent] = []
        with self._lock:
            if self.write == "through":
                for i in range(len(self.tiers)):
                    self._put(i, key, data, events)
            else:
                self._put(0, key, data, events)
        return events

    def _put(self, i: int, key: bytes, data: bytes, events: list[TierEvent]) -> None:
        tier = self.tiers[i]
        if not self._health(tier, events):
            if self.write == "back" and i + 1 < len(self.tiers):
                self._put(i + 1, key, data, events)  # a tier that is down is skipped, not a hole
            return
        evicted = tier.put(key, data)
        events += [TierEvent("removed", tier.name, k) for k in evicted if k != key]
        if key not in evicted:
            events.append(TierEvent("stored", tier.name, key, len(data)))
        elif self.write == "back" and i + 1 < len(self.tiers):
            self._put(i + 1, key, data, events)  # too big for this tier: the next one takes it
        self._health(tier, events)
        spill: dict[bytes, bytes] | None = getattr(tier, "spill", None)
        if spill and i + 1 < len(self.tiers):
            moved = list(spill.items())
            spill.clear()
            for k, d in moved:
                self._put(i + 1, k, d, events)

    def load(self, key: bytes) -> tuple[BlockPayload | None, str | None, list[TierEvent]]:
        """The block's payload from the fastest tier holding a valid object, its tier's name and
        what changed (a corrupt object deleted, a tier found down); (None, None, events) if none."""
        events: list[TierEvent] = []
        for tier in self.tiers:
            t0 = time.perf_counter()
            with self._lock:
                up = self._health(tier, events)
            data = tier.read(key) if up else None
            with self._lock:
                if up:
                    tier.note_read(key, data)
                self._health(tier, events)
            if data is None:
                continue
            try:
                _, payload = object_format.decode(data, root=self.root, block_hash=key)
            except object_format.CorruptBlock as exc:
                log.warning("KV tier %s: corrupt block object %s deleted (%s)", tier.name, key.hex()[:12], exc)
                with self._lock:
                    tier.stats.checksum_failures += 1
                    tier.delete(key)
                events += [TierEvent("corrupt", tier.name, key), TierEvent("removed", tier.name, key)]
                continue
            with self._lock:
                tier.stats.loads += 1
                tier.stats.load_seconds += time.perf_counter() - t0
            return payload, tier.name, events
        return None, None, events

    def snapshot(self) -> dict[str, list[tuple[bytes, int]]]:
        """What each local tier holds now, (key, object size) (the remote tier is not listed)."""
        with self._lock:
            return {t.name: t.sized_keys() for t in self.tiers if t.name != "remote"}  # type: ignore[attr-defined]
