"""Routing policies: where a request goes among live replicas. Pure logic over plain data.

``kv`` (the exact, tier-aware router), in order:
  1. **sticky**: a session's turn goes to the replica that served its last turn, unless that
     replica is gone or has ``overload_waiting`` or more requests waiting;
  2. **prefix**: else the replica with the lowest cost, where cost = blocks it would have to
     compute or load (a block held in tier t costs ``1 − TIER_WEIGHT[t]``, one it lacks costs 1)
     + ``load_weight`` × requests in flight there; chosen when some replica holds a prefix;
  3. **least_loaded**: else the replica with the fewest requests in flight (then most free blocks).

``round_robin`` and ``session_hash`` (a stable hash of the routing key, else round robin) are the
baselines the benchmark compares against. Every policy counts its decisions by reason.

Invariants: a decision names a live replica; with no live replica ``choose`` raises
:class:`NoReplica`; ties break by replica name, so a decision is a function of its inputs (and,
for round robin, of how many decisions came before).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from kvserve.cluster.index import BlockIndex
from kvserve.cluster.records import Decision, ReplicaLoad, RouteQuery

TIER_WEIGHT: dict[str, float] = {"pool": 1.0, "host": 0.8, "disk": 0.5, "remote": 0.3}
POLICIES = ("kv", "round_robin", "session_hash")


class NoReplica(RuntimeError):
    """No replica is alive to take the request."""


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "kv"
    load_weight: float = 2.0      # blocks of recompute one request in flight is worth
    overload_waiting: int = 8     # a sticky replica with this many waiting is passed over

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.load_weight < 0 or self.overload_waiting < 1:
            raise ValueError("load_weight must be >= 0 and overload_waiting >= 1")


class Policy(Protocol):
    decisions: Counter[str]

    def choose(self, query: RouteQuery, loads: Mapping[str, ReplicaLoad]) -> Decision: ...

    def forget_replica(self, replica: str) -> None: ...


def _live(loads: Mapping[str, ReplicaLoad]) -> list[str]:
    if not loads:
        raise NoReplica("no replica is alive")
    return sorted(loads)


def _least_loaded(loads: Mapping[str, ReplicaLoad]) -> str:
    return min(_live(loads), key=lambda r: (loads[r].in_flight, -loads[r].blocks_free, r))


class RoundRobin:
    def __init__(self) -> None:
        self.decisions: Counter[str] = Counter()
        self._n = 0

    def choose(self, query: RouteQuery, loads: Mapping[str, ReplicaLoad]) -> Decision:
        live = _live(loads)
        replica = live[self._n % len(live)]
        self._n += 1
        self.decisions["round_robin"] += 1
        return Decision(replica, "round_robin")

    def forget_replica(self, replica: str) -> None:
        pass


class SessionHash(RoundRobin):
    def choose(self, query: RouteQuery, loads: Mapping[str, ReplicaLoad]) -> Decision:
        key = query.session_id or query.routing_key
        if key is None:
            return super().choose(query, loads)
        live = _live(loads)
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
        self.decisions["session_hash"] += 1
        return Decision(live[h % len(live)], "session_hash")


class KVRouter:
    """The exact router: reads ``index`` (fed by the replicas' cache events) and the loads."""

    def __init__(self, index: BlockIndex, config: RouterConfig | None = None) -> None:
        self.index = index
        self.config = config or RouterConfig()
        self.decisions: Counter[str] = Counter()
        self.sessions: dict[str, str] = {}  # session → the replica of its last turn

    def choose(self, query: RouteQuery, loads: Mapping[str, ReplicaLoad]) -> Decision:
        live = _live(loads)
        d = self._sticky(query, loads) or self._prefix(query, loads, live) or \
            Decision(_least_loaded(loads), "least_loaded")
        if query.session_id is not None:
            self.sessions[query.session_id] = d.replica
        self.decisions[d.reason] += 1
        return d

    def _sticky(self, query: RouteQuery, loads: Mapping[str, ReplicaLoad]) -> Decision | None:
        replica = self.sessions.get(query.session_id) if query.session_id is not None else None
        if replica is None or replica not in loads:
            return None
        if loads[replica].num_waiting >= self.config.overload_waiting:
            return None
        return Decision(replica, "sticky", self.index.prefix(replica, query.block_hashes))

    def _prefix(self, query: RouteQuery, loads: Mapping[str, ReplicaLoad], live: list[str]) -> Decision | None:
        n = len(query.block_hashes)
        held = {r: self.index.prefix(r, query.block_hashes) for r in live}
        if not any(held.values()):
            return None

        def cost(r: str) -> tuple[float, str]:
            saved = sum(TIER_WEIGHT[t] for t in held[r])
            return n - saved + self.config.load_weight * loads[r].in_flight, r

        replica = min(live, key=cost)
        return Decision(replica, "prefix", held[replica])

    def session_replica(self, session_id: str) -> str | None:
        return self.sessions.get(session_id)

    def forget_replica(self, replica: str) -> None:
        """A replica died: its sessions lose their stickiness (their next turn is routed anew)."""
        self.index.drop(replica)
        for sid in [s for s, r in self.sessions.items() if r == replica]:
            del self.sessions[sid]


def make_policy(config: RouterConfig, index: BlockIndex) -> Policy:
    if config.policy == "kv":
        return KVRouter(index, config)
    if config.policy == "session_hash":
        return SessionHash()
    return RoundRobin()
