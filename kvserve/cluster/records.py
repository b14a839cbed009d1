"""What crosses between a replica and the router: plain, frozen data (pickles through Ray).

Invariants:
  * a replica numbers its :class:`ReplicaEvent`s from one counter, 1, 2, 3 … with no gap; a
    :class:`ReplicaPoll` carries the events after the ``since`` it was asked for, in order, or
    (``snapshot`` set) the replica's whole block map as of ``seq`` when those events are gone;
  * tiers are named ``pool``, ``host``, ``disk``, ``remote`` (fastest first, :data:`TIER_ORDER`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TIER_ORDER: tuple[str, ...] = ("pool", "host", "disk", "remote")


@dataclass(frozen=True)
class ReplicaEvent:
    """``kind`` is ``"stored"`` (the block is findable in ``tier`` of this replica) or
    ``"removed"`` (it no longer is)."""

    seq: int
    kind: str
    tier: str
    block_hash: bytes


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica's queue and pool, as of its last step."""

    num_running: int = 0
    num_waiting: int = 0
    blocks_free: int = 0
    blocks_total: int = 1

    @property
    def in_flight(self) -> int:
        return self.num_running + self.num_waiting


@dataclass(frozen=True)
class ReplicaPoll:
    """Events after ``since`` up to ``seq`` (or a full ``snapshot`` at ``seq``) and the load."""

    seq: int
    events: tuple[ReplicaEvent, ...] = ()
    snapshot: dict[str, tuple[bytes, ...]] | None = None  # tier → block hashes, when events are gone
    load: ReplicaLoad = field(default_factory=ReplicaLoad)


@dataclass(frozen=True)
class RouteQuery:
    """One request to place: its prompt's full-block hashes (under its request root), the
    session it continues (sticky) and a routing key (the conversation, for session-hash)."""

    block_hashes: tuple[bytes, ...]
    session_id: str | None = None
    routing_key: str | None = None


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why: ``reason`` is ``sticky``, ``prefix``, ``least_loaded``,
    ``round_robin`` or ``session_hash``; ``matched_blocks`` the prefix the replica holds, with
    the tier of each block."""

    replica: str
    reason: str
    matched_tiers: tuple[str, ...] = ()

    @property
    def matched_blocks(self) -> int:
        return len(self.matched_tiers)
