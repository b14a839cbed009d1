"""The offline oracle: replay a run's routing decisions against every replica's cache events.

At each decision the router recorded the prompt's block hashes, the replica it chose and each
replica's event sequence number at that moment. Replaying each replica's event log up to those
numbers gives every replica's exact cache at every decision, so, per decision:

  * ``achieved`` = prompt blocks the chosen replica held (a prefix, any tier);
  * ``oracle``   = the most any live replica held: what a router that knows every cache at every
    moment, and ignores load, would have reused.

Both are capped at ``(prompt_len − 1) // block_size`` blocks, as the engine caps a hit (one
token is always recomputed). Session turns (no prompt hashes) count for nothing. Plain Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvserve.cluster.index import BlockIndex
from kvserve.cluster.records import ReplicaEvent, ReplicaPoll


@dataclass(frozen=True)
class OracleResult:
    blocks: int      # prompt full blocks over all decisions
    achieved: int    # blocks the chosen replicas held
    oracle: int      # blocks the best replica held

    @property
    def achieved_rate(self) -> float:
        return self.achieved / self.blocks if self.blocks else 0.0

    @property
    def oracle_rate(self) -> float:
        return self.oracle / self.blocks if self.blocks else 0.0

    @property
    def ratio(self) -> float:
        """achieved ÷ oracle (1.0 when the oracle found nothing to reuse either)."""
        return self.achieved / self.oracle if self.oracle else 1.0


def replay_oracle(decisions: Sequence[object], logs: Mapping[str, Sequence[ReplicaEvent]],
                  block_size: int) -> OracleResult:
    """``decisions``: :class:`~kvserve.cluster.replica_set.DecisionRecord`s in the order they
    were made; ``logs``: each replica's whole event log from its first event."""
    index = BlockIndex()
    pos = {r: 0 for r in logs}
    for r in logs:
        index.apply(r, ReplicaPoll(0, snapshot={}))
    blocks = achieved = oracle = 0
    for rec in decisions:
        seqs: dict[str, int] = rec.seqs  # type: ignore[attr-defined]
        for r, log in logs.items():
            upto = seqs.get(r)
            if upto is None:
                continue
            end = pos[r]
            while end < len(log) and log[end].seq <= upto:
                end += 1
            if end > pos[r]:
                index.apply(r, ReplicaPoll(log[end - 1].seq, tuple(log[pos[r]:end])))
                pos[r] = end
        hashes = rec.block_hashes  # type: ignore[attr-defined]
        n = rec.num_tokens  # type: ignore[attr-defined]
        cap = min(len(hashes), (n - 1) // block_size) if n else 0
        held = {r: min(cap, len(index.prefix(r, hashes))) for r in logs if r in seqs}
        blocks += cap
        achieved += held.get(rec.decision.replica, 0)  # type: ignore[attr-defined]
        oracle += max(held.values(), default=0)
    return OracleResult(blocks, achieved, oracle)
