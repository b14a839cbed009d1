"""The KV manager's side of the tiers: what to save, what a prefix lookup finds below the pool,
and bringing found blocks back into the pool's prefix cache. Block ids and hashes only, no torch.

Loading does not stall the step. The request waits in the scheduler's ``loading`` set, taking no
token budget, while every other request keeps running::

    step N     begin: hold the request's pool hits (so they are not evicted), allocate one block
               per tier hit, queue LoadBlock(hash, block) ops; the runner reads them from the
               tiers on its loader thread while step N's forward runs
    step N..M  receive (RunnerOutput.loaded): results arrive as reads finish, in any order
    step M     the last result is in: blocks are made findable by their hash in table order, up to
               the first failed one; every held block is released (cached-free)
    step M+1   the request is admitted as usual: the prefix cache now covers what was loaded

A request consults the tiers once; what fails to load is recomputed, never retried. A request
that ends while its loads are in flight leaves its :class:`Loading` behind until every result is
in (the runner writes into the target blocks until then); only then are the blocks released.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvserve.contract import BlockOp, LoadBlock, LoadResult, SaveBlock, TierEvent
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.events import BlockRemoved
from kvserve.kv.hashing import BlockHash
from kvserve.kv.tiers.index import TierIndex


@dataclass
class Loading:
    """A request's blocks in flight from the tiers: ``held`` pool blocks (hits, then the loads'
    targets, in table order) and, per load, its hash, target block and the tier it comes from.
    ``results`` fills in as the runner reports them (keyed by target block); complete when it
    has one per load."""

    held: list[int]
    loads: list[tuple[BlockHash, int, str]]
    hit_tokens: dict[str, int] = field(default_factory=dict)  # filled by finish
    load_seconds: float = 0.0
    results: dict[int, LoadResult] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.results) == len(self.loads)
    failed: frozenset[BlockHash] = frozenset()  # loads from the first that failed on (recomputed)


class TierSeam:
    """``write="through"``: a block is saved when it becomes findable in the pool. ``"back"``: when
    the pool evicts it (its ``BlockRemoved`` event, raised while the block is handed out again, so
    the save is queued ahead of whatever overwrites it in the same step)."""

    def __init__(self, pool: BlockPool, block_size: int, tiers: Iterable[str] = (), write: str = "through",
                 ops: list[BlockOp] | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.index = TierIndex(tiers)
        self.write = write
        self._ops = ops if ops is not None else []
        self._in_flight: dict[int, Loading] = {}  # target block -> its loading, until reported
        self.subscribers: list[Callable[[list[TierEvent]], None]] = []  # a replica's router feed
        if self.index and write == "back":
            pool.subscribe(self._on_pool_event)

    def _on_pool_event(self, event: object) -> None:
        if isinstance(event, BlockRemoved) and self.index.best(event.block_hash) is None:
            self._ops.append(SaveBlock(event.block_id, event.block_hash))

    def __bool__(self) -> bool:
        return bool(self.index)

    def apply(self, events: Iterable[TierEvent]) -> None:
        """Update the index, then tell each subscriber the same events, in order."""
        events = list(events)
        self.index.apply(events)
        for sub in self.subscribers:
            sub(events)

    def save_op(self, block_id: int, block_hash: BlockHash, parent: BlockHash) -> SaveBlock | None:
        """Write-through: a block that just became findable in the pool goes to the tiers, unless
        the fastest tier already holds it."""
        if not self.index or self.write != "through" or self.index.best(block_hash) is not None:
            return None
        return SaveBlock(block_id, block_hash, parent)

    def hits(self, hashes: Sequence[BlockHash], start: int, limit: int) -> list[tuple[BlockHash, str]]:
        """Blocks ``start..limit-1`` of a prefix found in the tiers, in order, stopping at a miss."""
        out: list[tuple[BlockHash, str]] = []
        for h in hashes[start:limit]:
            tier = self.index.probe(h)
            if tier is None:
                break
            out.append((h, tier))
        return out

    def begin(self, pool_hits: Sequence[int | None], tier_hits: list[tuple[BlockHash, str]],
              ops: list[BlockOp]) -> Loading | None:
        """Hold the pool hits (a ``None`` one, outside the request's window, is not held) and
        allocate targets for as many tier hits as free blocks allow."""
        pool_hits = [b for b in pool_hits if b is not None]
        n = min(len(tier_hits), self.pool.num_free - sum(1 for b in pool_hits if self.pool.ref_count(b) == 0))
        if n <= 0:
            return None
        self.pool.touch(list(pool_hits))
        targets = self.pool.allocate(n)
        loads = [(h, b, tier) for (h, tier), b in zip(tier_hits[:n], targets)]
        ops.extend(LoadBlock(h, b, tier) for h, b, tier in loads)
        loading = Loading(list(pool_hits) + targets, loads)
        self._in_flight.update((b, loading) for b in targets)
        return loading

    @property
    def loads_in_flight(self) -> int:
        return len(self._in_flight)

    def held_refs(self) -> int:
        """Pool references the loadings in flight hold (for the manager's accounting check)."""
        return sum(len(loading.held) for loading in {id(x): x for x in self._in_flight.values()}.values())

    def receive(self, results: Iterable[LoadResult]) -> list[Loading]:
        """Record load results; the loadings now complete are finished (their prefix made
        findable, their blocks released) and returned, those of requests that ended included."""
        done: list[Loading] = []
        for r in results:
            loading = self._in_flight.pop(r.block_id, None)
            if loading is None:
                continue
            loading.results[r.block_id] = r
            if loading.complete:
                self.finish(loading)
                done.append(loading)
        return done

    def finish(self, loading: Loading) -> None:
        """Make the loaded prefix findable, then release every held block."""
        ok = True
        for j, (h, block, _) in enumerate(loading.loads):
            r = loading.results.get(block)
            ok = ok and r is not None and r.tier is not None
            if not ok:
                loading.failed = frozenset(x for x, _, _ in loading.loads[j:])
                break
            assert r is not None and r.tier is not None
            c = self.index.counters.get(r.tier)
            if c is not None:
                c.observe_load(r.seconds)
            self.pool.cache(block, h)
            loading.hit_tokens[r.tier] = loading.hit_tokens.get(r.tier, 0) + self.block_size
            loading.load_seconds += r.seconds
        self.release(loading)

    def release(self, loading: Loading) -> None:
        self.pool.free(list(reversed(loading.held)))
        loading.held = []
