"""Why a prompt's tokens were not found in the prefix cache: one reason per missed token.

Plain Python over block hashes (no torch). Two bounded records let a miss be explained:

* ``evicted``: hashes the pool recently evicted (a ``BlockRemoved`` event), with the pool's
  eviction policy: a block asked for again after that is ``evicted:<policy>``, not ``never_seen``;
* ``seen``: the *content* hash of every block cached recently (its tokens chained from the
  engine's root, without salt or codec) with the (salt, codec) it was cached under: the same
  tokens under another salt are ``different_salt``, under another codec ``different_codec``.

Reasons (``REASONS``): ``never_seen``, ``evicted:<policy>``, ``dropped_window`` (a ``sinks``
request computes its own KV past its canonical boundary, :mod:`kvserve.kv.forgetting`),
``dropped_policy`` (same for importance policies), ``different_salt``, ``different_codec``,
``partial_block`` (the tokens after the last full block, and the last token, which is always
recomputed), ``tier_load_failed`` (a tier held the block but loading it failed). A block that is
in the pool but unreachable (an earlier block of its chain missed) takes its predecessor's reason.

Invariant: ``sum(classify(...).values()) == missed tokens``; each record holds at most
``capacity`` entries (oldest forgotten first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvserve.kv.events import BlockRemoved, CacheEvent
from kvserve.kv.hashing import BlockHash

if TYPE_CHECKING:
    from kvserve.kv.block_pool import BlockPool
    from kvserve.kv.manager import ComputedBlocks
    from kvserve.request import Request

REASONS = ("never_seen", "evicted", "dropped_window", "dropped_policy", "different_salt", "different_codec",
           "partial_block", "tier_load_failed")


class MissLedger:
    def __init__(self, policy: str = "lru", capacity: int = 65536) -> None:
        self.policy = policy
        self.capacity = capacity
        self.evicted: OrderedDict[BlockHash, None] = OrderedDict()
        self.seen: OrderedDict[BlockHash, set[tuple[str | None, str | None]]] = OrderedDict()

    def on_event(self, event: CacheEvent) -> None:
        """A pool subscriber: remember what was evicted."""
        if isinstance(event, BlockRemoved):
            self._put(self.evicted, event.block_hash, None)

    def cached(self, content: BlockHash, block_hash: BlockHash, salt: str | None, codec: str | None) -> None:
        """A block became findable: its content was seen under (salt, codec)."""
        self.evicted.pop(block_hash, None)
        keys = self.seen.get(content) or set()
        keys.add((salt, codec))
        self._put(self.seen, content, keys)

    def _put(self, record: OrderedDict, key: BlockHash, value: object) -> None:  # type: ignore[type-arg]
        record[key] = value
        record.move_to_end(key)
        while len(record) > self.capacity:
            record.popitem(last=False)

    def classify(self, num_tokens: int, num_hit: int, block_size: int, hashes: Sequence[BlockHash],
                 contents: Sequence[BlockHash], salt: str | None, codec: str | None,
                 in_pool: Callable[[BlockHash], bool], canonical: int | None = None, lossy_reason: str = "",
                 failed: frozenset[BlockHash] = frozenset()) -> dict[str, int]:
        """Reasons for the tokens ``num_hit .. num_tokens - 1`` (those not found). ``hashes`` /
        ``contents``: the request's full blocks' hashes and content hashes; ``canonical``: the
        request's canonical boundary (``lossy_reason`` past it)."""
        out: dict[str, int] = {}
        lookable = (num_tokens - 1) // block_size  # full blocks a lookup may return
        prev = "never_seen"
        first = -(-num_hit // block_size)
        if num_hit % block_size:  # a session's partial block: the rest of it is new
            out["partial_block"] = first * block_size - num_hit
        for i in range(first, lookable):
            reason = self._reason(i, block_size, hashes[i], contents[i], salt, codec, in_pool, canonical,
                                  lossy_reason, failed, prev)
            out[reason] = out.get(reason, 0) + block_size
            prev = reason
        tail = num_tokens - max(first, lookable) * block_size
        if tail > 0:
            out["partial_block"] = out.get("partial_block", 0) + tail
        return out

    def _reason(self, i: int, block_size: int, h: BlockHash, content: BlockHash, salt: str | None,
                codec: str | None, in_pool: Callable[[BlockHash], bool], canonical: int | None,
                lossy_reason: str, failed: frozenset[BlockHash], prev: str) -> str:
        if canonical is not None and (i + 1) * block_size > canonical:
            return lossy_reason
        if h in failed:
            return "tier_load_failed"
        if in_pool(h):
            return prev  # there, but an earlier block of the chain was not
        if h in self.evicted:
            return f"evicted:{self.policy}"
        keys = self.seen.get(content, set())
        if any(s == salt and c != codec for s, c in keys):  # this tenant's, under another codec
            return "different_codec"
        if any(s != salt for s, _ in keys):
            return "different_salt"
        return "different_codec" if keys else "never_seen"


class MissReasons:
    """The KV manager's side (a mixin of :class:`kvserve.kv.manager.KVCacheManager`)."""

    block_size: int
    enable_prefix_caching: bool
    pool: BlockPool
    misses: MissLedger

    if TYPE_CHECKING:
        def _block_hashes(self, req: Request) -> list[BlockHash]: ...  # kvserve.kv.hash_carry's
        def _content_hashes(self, req: Request) -> list[BlockHash]: ...  # kvserve.kv.hash_carry's
        def canonical_tokens(self, req: Request) -> int | None: ...  # the forgetting mixin's

    def miss_reasons(self, req: Request, computed: ComputedBlocks) -> dict[str, int]:
        """Why ``req``'s tokens after ``computed`` were not found (:mod:`kvserve.kv.miss_ledger`);
        empty with prefix caching off."""
        if not self.enable_prefix_caching or computed.num_tokens >= req.num_tokens:
            return {}
        press = req.kv_press
        lossy = "dropped_window" if press is not None and press.name == "sinks" else "dropped_policy"
        return self.misses.classify(req.num_tokens, computed.num_tokens, self.block_size, self._block_hashes(req),
                                    self._content_hashes(req), req.cache_salt, req.kv_cache_dtype,
                                    lambda h: self.pool.lookup(h) is not None, self.canonical_tokens(req), lossy,
                                    req.kv_failed_loads)

