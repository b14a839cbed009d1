"""The plain records the KV manager's seam speaks: where computed KV came from, what a prefix
lookup found, the prefix cache's counters, and an allocation plan. No torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class BlockSource(enum.Enum):
    """Where a request's already-computed KV came from."""

    NONE = "none"
    PREFIX = "prefix"    # the prefix cache (full blocks found by chained hash)
    SESSION = "session"  # its session's blocks, moved over as they are
    FORK = "fork"        # its leader's prompt blocks (n > 1 siblings)


@dataclass(frozen=True)
class ComputedBlocks:
    """KV already computed for a request's first ``num_tokens`` tokens, held in ``blocks``."""

    blocks: tuple[int | None, ...] = ()  # None: dropped (outside the request's window), not taken
    num_tokens: int = 0
    source: BlockSource = BlockSource.NONE


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (once per admission)
    hits: int = 0     # of those, tokens whose KV was reused

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class _Plan:
    need_new: int
    cow: list[int] = field(default_factory=list)  # indices into the new table to copy first
    revived: int = 0

    @property
    def blocks_wanted(self) -> int:
        return self.need_new + len(self.cow) + self.revived
NO_BLOCKS = ComputedBlocks()  # a lookup that found nothing (immutable: safe as a default)
