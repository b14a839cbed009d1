"""Prefixes held in the pool until a deadline: the prompt-caching API (docs/tiers.md).

A request may ask for the KV of its prompt's first N tokens to be kept (``cache_control`` on a
message: ``{"type": "ephemeral", "ttl": "5m" | "1h"}``; or ``prompt_cache_key``, which keeps the
latest prompt sent under that key for 5 minutes). When it finishes, the full blocks of that prefix
are *pinned*: each holds one extra pool reference, so the prefix cache cannot evict them. A pin is
refreshed (its deadline pushed back by its TTL) every time a request's prefix hit reaches its last
block, and released when the deadline passes.

A pin is a strong preference, not a reservation: under memory pressure, after idle sessions, the
least recently used pins are released first (with tiers configured their blocks are in the tiers
already, so a later hit loads instead of recomputing), and pins together never hold more than
``max_blocks``. Nothing ever waits or fails for a pin.

Invariants (``check``): a pin holds exactly one reference per entry of ``blocks``;
``held_refs() == sum(len(p.blocks))``; ``_by_last`` maps each pin's last block to it. Plain data,
no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.hashing import BlockHash
from kvserve.request import Request

TTLS = {"5m": 300.0, "1h": 3600.0}  # the hosted APIs' two lifetimes
KEY_TTL_S = TTLS["5m"]  # what prompt_cache_key keeps its latest prompt for
MAX_BREAKPOINTS = 4     # cache_control markers per request, as hosted APIs allow


def cache_pins(cache_control: Sequence[tuple[int, float]], prompt_cache_key: str | None, num_prompt_tokens: int,
               in_session: bool) -> tuple[tuple[str | None, int, float], ...]:
    """A request's pins as ``Request.cache_pins``; raises ValueError for ones it cannot have."""
    if in_session and (cache_control or prompt_cache_key):
        raise ValueError("cache_control and prompt_cache_key do not apply to session turns: the session "
                         "keeps its history's KV (docs/tiers.md)")
    if len(cache_control) > MAX_BREAKPOINTS:
        raise ValueError(f"at most {MAX_BREAKPOINTS} cache_control breakpoints per request, got {len(cache_control)}")
    pins: list[tuple[str | None, int, float]] = []
    for n, ttl in cache_control:
        if not 0 < n <= num_prompt_tokens or not 0 < ttl <= 86_400:
            raise ValueError(f"cache_control prefix of {n} tokens for {ttl} s: needs 1..{num_prompt_tokens} "
                             "tokens (the prompt) and a TTL of up to a day")
        pins.append((None, n, float(ttl)))
    if prompt_cache_key is not None:
        if not prompt_cache_key or len(prompt_cache_key) > 256:
            raise ValueError("prompt_cache_key must be 1..256 characters")
        pins.append((prompt_cache_key, num_prompt_tokens, KEY_TTL_S))
    return tuple(pins)


@dataclass
class Pin:
    key: tuple[str | None, ...]
    blocks: list[int]
    ttl_s: float
    expires_at: float

    @property
    def last(self) -> int:
        return self.blocks[-1]


@dataclass
class PinStats:
    created: int = 0
    refreshed: int = 0
    expired: int = 0
    evicted: int = 0  # released early: memory pressure or the pin budget


class PrefixPins:
    def __init__(self, pool: BlockPool, clock: Callable[[], float], max_blocks: int) -> None:
        self.pool = pool
        self.clock = clock
        self.max_blocks = max_blocks
        self._pins: OrderedDict[tuple[str | None, ...], Pin] = OrderedDict()  # least recently used first
        self._by_last: dict[int, list[tuple[str | None, ...]]] = {}
        self.stats = PinStats()

    def __len__(self) -> int:
        return len(self._pins)

    def held_refs(self) -> int:
        return sum(len(p.blocks) for p in self._pins.values())

    def pin(self, key: tuple[str | None, ...], blocks: list[int], ttl_s: float) -> bool:
        """Pin ``blocks`` (cached, findable) under ``key`` for ``ttl_s``; a pin already there on the
        same blocks is refreshed (its TTL the longer of both). Returns True if a new pin was made
        (the prefix was *written* to the cache), False on a refresh or when it cannot be held."""
        if not blocks or len(blocks) > self.max_blocks:
            return False
        now = self.clock()
        old = self._pins.get(key)
        if old is not None and old.blocks == blocks:
            old.ttl_s = max(old.ttl_s, ttl_s)
            old.expires_at = max(old.expires_at, now + ttl_s)
            self._pins.move_to_end(key)
            self.stats.refreshed += 1
            return False
        if old is not None:
            self._release(old)  # a key names one prefix: the newest replaces the old
        while self.held_refs() + len(blocks) > self.max_blocks and self._pins:
            self._release(next(iter(self._pins.values())))
            self.stats.evicted += 1
        self.pool.touch(list(blocks))
        pin = Pin(key, list(blocks), ttl_s, now + ttl_s)
        self._pins[key] = pin
        self._by_last.setdefault(pin.last, []).append(key)
        self.stats.created += 1
        return True

    def pin_request(self, req: Request, hashes: Sequence[BlockHash], root: BlockHash, block_size: int,
                    table_blocks: int) -> None:
        """Pin the full blocks of each prefix a finished ``req`` asked for (``req.cache_pins``),
        the findable copy of each; sets ``req.cache_write_tokens``: what was pinned anew beyond the
        tokens it read from the cache. A key names ``(request root, prompt_cache_key)``, so pins
        stay within a tenant's salt and codec; a breakpoint's key is its last block's hash."""
        written = 0
        for name, num_tokens, ttl_s in req.cache_pins:
            k = min(num_tokens, req.num_computed_tokens, table_blocks * block_size) // block_size
            found = [self.pool.lookup(h) for h in hashes[:k]]
            if k == 0 or None in found:
                continue  # part of the prefix is not findable: nothing to pin
            blocks = [b for b in found if b is not None]
            key = ("key", root.hex(), name) if name is not None else ("prefix", hashes[k - 1].hex())
            if self.pin(key, blocks, ttl_s):
                written = max(written, k * block_size)
        req.cache_write_tokens = max(0, written - req.num_cached_tokens)

    def refresh_hits(self, blocks: Iterable[int]) -> None:
        """A request's prefix hit covered ``blocks``: the pins ending inside it live another TTL."""
        now = self.clock()
        for b in blocks:
            for key in self._by_last.get(b, ()):
                pin = self._pins[key]
                pin.expires_at = now + pin.ttl_s
                self._pins.move_to_end(key)
                self.stats.refreshed += 1

    def expire(self) -> int:
        """Release the pins past their deadline; returns how many."""
        now = self.clock()
        gone = [p for p in self._pins.values() if p.expires_at <= now]
        for p in gone:
            self._release(p)
        self.stats.expired += len(gone)
        return len(gone)

    def release_lru(self) -> bool:
        """Memory pressure: release the least recently used pin. False if there is none."""
        if not self._pins:
            return False
        self._release(next(iter(self._pins.values())))
        self.stats.evicted += 1
        return True

    def _release(self, pin: Pin) -> None:
        del self._pins[pin.key]
        keys = self._by_last[pin.last]
        keys.remove(pin.key)
        if not keys:
            del self._by_last[pin.last]
        self.pool.free(list(reversed(pin.blocks)))

    def check(self) -> None:
        assert self.held_refs() <= self.max_blocks, "pins over their budget"
        for key, pin in self._pins.items():
            assert pin.blocks and key in self._by_last[pin.last], "pin index out of sync"
            assert all(self.pool.ref_count(b) >= 1 for b in pin.blocks), "a pinned block lost its reference"
        assert sum(len(v) for v in self._by_last.values()) == len(self._pins), "pin index out of sync"
