"""The narrow seam between the scheduler and the KV cache.

The scheduler asks four things: which of a request's tokens already have KV
(``get_computed_blocks``), to allocate slots for N new tokens (``allocate_slots``), to free a
request (``free``), and how full the pool is (``usage``). Block tables are plain lists of block
ids; no torch here.

Where computed KV comes from, in order of preference:

1. the request's **session** (its whole history, partial last block included, moved over as is);
2. its **leader** (``n > 1``: a sibling shares every prompt block of the first sample and
   recomputes only the last prompt token);
3. the **prefix cache** (full blocks found by chained hash).

A block about to be written while another holder shares it is **copied first** (copy-on-write):
the copy is queued as a ``CopyBlock`` for the runner, so the other sharers keep their tokens. With
KV tiers configured, a block that becomes findable is also queued as a ``SaveBlock`` (write-through)
and a prefix lookup continues below the pool (:mod:`kvserve.kv.tier_seam`). Block operations leave
in the order they were queued, which is the order the storage runs them.

A finished request may **pin** prefixes of its prompt (the prompt-caching API's ``cache_control``
and ``prompt_cache_key``: :mod:`kvserve.kv.prefix_pins`): their blocks stay in the pool until a
deadline that every hit pushes back.

A block table may hold **dropped** entries (``None``): blocks the request gave back because no
query of its reads them again (the model's sliding window, a ``sinks`` or importance policy:
:mod:`kvserve.kv.press`). A dropped block stays findable by its hash for other requests, like
any freed block; a request never writes into or reads a dropped entry.

When the pool runs short, free blocks go first (never-cached, then cached-free in LRU order, by the
pool), then idle resident sessions (LRU), then pins (LRU); only then does the scheduler preempt
running requests.

Invariant (``check()``): every reference a block holds belongs to exactly one held (not dropped)
block-table entry, session block, pin entry or tier load in flight, so ``sum(ref counts) ==
held table and session entries + pinned blocks + blocks held by loads``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvserve.contract.block_ops import BlockOp, CopyBlock
from kvserve.kv.block_pool import BlockPool, PoolUsage
from kvserve.kv.forgetting import Forgetting
from kvserve.kv.hash_carry import HashCarry, ParkedHashes
from kvserve.kv.hashing import BlockHash, hash_full_blocks, request_root, root_key
from kvserve.kv.manager_records import NO_BLOCKS, BlockSource, ComputedBlocks, PrefixCacheStats, _Plan
from kvserve.kv.miss_ledger import MissLedger, MissReasons
from kvserve.kv.peer_seam import PeerTransfers
from kvserve.kv.prefix_pins import PrefixPins
from kvserve.kv.sessions import Session, SessionTable
from kvserve.kv.tier_seam import Loading, TierSeam
from kvserve.request import Request, RequestStatus


def default_root_key(block_size: int) -> BlockHash:
    """The root of a manager built without an engine (tests, tools): no model named."""
    return root_key("unnamed-model", "unnamed-codec", block_size)


class KVCacheManager(Forgetting, MissReasons, HashCarry):
    """Block tables over one :class:`BlockPool`, with prefix caching and sessions."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 root_key: BlockHash | None = None, session_idle_timeout_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic, session_retention_s: float | None = None,
                 max_sessions_per_tenant: int | None = None, tiers: tuple[str, ...] = (),
                 session_demote_after_s: float | None = None, tier_write: str = "through",
                 max_pinned_blocks: int | None = None, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window  # the model's own window: blocks outside it are freed
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        # names the model, codec and block size: every block hash chains from it (kv/hashing.py)
        self.root_key = root_key if root_key is not None else default_root_key(block_size)
        self.stats = PrefixCacheStats()
        self.sessions = SessionTable(session_idle_timeout_s, clock, session_retention_s, max_sessions_per_tenant)
        self._ops: list[BlockOp] = []  # block operations for the next step, in order
        self.tiers = TierSeam(self.pool, block_size, tiers, tier_write, self._ops)
        self.pins = PrefixPins(self.pool, clock, num_blocks // 2 if max_pinned_blocks is None else max_pinned_blocks)
        self.peers = PeerTransfers(self.pool)  # blocks held for transfers to and from other engines
        # with tiers below the pool, an idle session's pool copy goes early: its KV stays in the tiers
        self.session_demote_after_s = session_demote_after_s if tiers else None
        self._tables: dict[str, list[int | None]] = {}
        self.dropped_blocks = 0  # blocks given back by windows and policies (a counter)
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}
        self._lossy_from: dict[str, int] = {}
        self._scores: dict[str, list[float]] = {}
        self.misses = MissLedger(policy="lru")  # why prompt tokens were not found (usage.kv.miss_tokens)
        self.pool.subscribe(self.misses.on_event)
        self._content_root = request_root(self.root_key, "\x00content", "\x00content")
        self._contents: dict[str, list[BlockHash]] = {}
        self._parked: dict[str, ParkedHashes] = {}  # session id -> its last turn's chains (hash_carry)

    # -- queries -----------------------------------------------------------------------------
    def block_table(self, request_id: str) -> list[int | None]:
        return self._tables.get(request_id, [])

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> PoolUsage:
        return self.pool.usage()

    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by sessions between turns (a block shared by several sessions,
        e.g. a common system prompt, counts once)."""
        return len({b for s in self.sessions.all() for b in s.blocks})

    def tokens_held(self, num_computed: dict[str, int]) -> int:
        """Tokens whose KV sits in used blocks (read-only; for the fragmentation metric).
        ``num_computed`` maps a live request id to its computed tokens (a table missing from it
        counts as full); a session holds ``num_computed``. A block shared by several holders
        counts once, at its fullest, so the result is at most ``used blocks × block_size``."""
        bs = self.block_size
        fill: dict[int, int] = {}
        holders = [(t, num_computed.get(rid, len(t) * bs)) for rid, t in self._tables.items()]
        holders += [(s.blocks, s.num_computed) for s in self.sessions.all()]
        for table, n in holders:
            for i, b in enumerate(table):
                if b is None:
                    continue
                fill[b] = max(fill.get(b, 0), min(bs, max(0, n - i * bs)))
        return sum(fill.values())

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- the scheduler's calls ---------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> ComputedBlocks:
        """The longest reusable KV prefix of ``req``. At least one token is always left to compute,
        because the last position's logits are needed to sample. Blocks ``req``'s window would
        drop at once are not taken (``None`` entries)."""
        limit = req.num_tokens - 1
        session = self.sessions.get(req.session_id) if req.session_id else None
        if (session is not None and session.resident and session.num_computed <= limit
                and session.cache_salt == req.cache_salt  # another tenant's KV: the salted cache
                and self._holes_allowed(req, session.blocks, session.num_computed)):
            self._seed_from_session(req, session)
            return ComputedBlocks(tuple(session.blocks), session.num_computed, BlockSource.SESSION)
        lead_table = self._tables.get(req.leader.request_id) if req.leader else None
        if lead_table and req.leader is not None and req.leader.num_computed_tokens >= req.num_prompt_tokens:
            n = req.num_prompt_tokens - 1
            blocks = lead_table[:self.blocks_needed(req.num_prompt_tokens)]
            if self._holes_allowed(req, blocks, n):
                return ComputedBlocks(self._unread_masked(req, blocks, n), n, BlockSource.FORK)
        if not self.enable_prefix_caching:
            return ComputedBlocks()
        hits: list[int] = []
        canonical = self.canonical_tokens(req)
        if canonical is not None:  # a lossy request computes its own KV past the boundary
            limit = min(limit, canonical)
        for h in self._block_hashes(req)[:limit // self.block_size]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        n = len(hits) * self.block_size
        return ComputedBlocks(self._unread_masked(req, hits, n), n, BlockSource.PREFIX if hits else BlockSource.NONE)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed: ComputedBlocks = NO_BLOCKS, evict_sessions: bool = True) -> bool:
        """Grow ``req``'s block table to hold ``num_computed_tokens + computed + num_new_tokens``
        tokens, copying shared blocks that this step writes. Releases idle sessions (LRU) if the
        pool is short (unless ``evict_sessions`` is False: speculative slots never evict a session).
        Returns False, changing nothing else, when the blocks cannot be had."""
        table = self._tables.get(req.request_id, []) + list(computed.blocks)
        start = req.num_computed_tokens + computed.num_tokens
        plan = self._plan(table, start, start + num_new_tokens, computed)
        while plan.blocks_wanted > self.pool.num_free:
            if not evict_sessions or not self._make_room(req):
                return False
            plan = self._plan(table, start, start + num_new_tokens, computed)
        self._take(req, computed)
        if computed.source is BlockSource.SESSION:
            # what the session held that this turn's window no longer reads goes back at once
            table = self._release_unread(req, table, start)
            self.note_inherited_holes(req, computed.blocks)
        for i in plan.cow:
            [fresh] = self.pool.allocate(1)
            old = table[i]
            assert old is not None
            self._ops.append(CopyBlock(old, fresh))
            self.pool.free([old])
            table[i] = fresh
        if plan.need_new > 0:
            table.extend(self.pool.allocate(plan.need_new))
        self._tables[req.request_id] = table
        return True

    def _make_room(self, req: Request) -> bool:
        """Release one holder of idle KV: an idle session (LRU) other than ``req``'s, else a pin
        (LRU). False when there is none left."""
        victim = next((s for s in self.sessions.resident() if s.session_id != req.session_id), None)
        if victim is not None:
            self.release_session(victim, evicted=True)
            return True
        return self.pins.release_lru()
    def trim(self, req: Request) -> None:
        """Return the blocks past ``req.num_computed_tokens`` (slots of rejected draft tokens:
        never full of computed tokens, so never hashed), tail first."""
        table = self._tables.get(req.request_id)
        if table is None:
            return
        keep = self.blocks_needed(req.num_computed_tokens)
        if len(table) > keep:
            self.pool.free(list(reversed(table[keep:])))
            del table[keep:]

    def _plan(self, table: list[int], start: int, end: int, computed: ComputedBlocks) -> _Plan:
        touched = set(computed.blocks) if computed.source in (BlockSource.PREFIX, BlockSource.FORK) else set()
        touched.discard(None)
        plan = _Plan(need_new=self.blocks_needed(end) - len(table))
        plan.revived = sum(1 for b in touched if b is not None and self.pool.ref_count(b) == 0)
        for i in range(start // self.block_size, min(len(table), self.blocks_needed(end))):
            b = table[i]
            assert b is not None, "a step never writes into a dropped block"
            holders = self.pool.ref_count(b) + (1 if b in touched else 0)
            if holders > 1:
                plan.cow.append(i)
        return plan

    def _take(self, req: Request, computed: ComputedBlocks) -> None:
        """Take the references of a hit: a session's blocks move over; others gain a reference."""
        first_admission, carried = req.request_id not in self._tables, 0
        if computed.source is BlockSource.SESSION:
            session = self.sessions.get(req.session_id or "")
            assert session is not None
            carried = self._carried_cached(req, session)
            self.sessions.take_blocks(session)
        else:
            self.pool.touch([b for b in computed.blocks if b is not None])
            if computed.source is BlockSource.PREFIX:
                self.pins.refresh_hits(b for b in computed.blocks if b is not None)
        if first_admission:
            self._num_cached[req.request_id] = len(computed.blocks) if computed.source is BlockSource.PREFIX else carried
            if self.enable_prefix_caching:
                self.stats.queries += req.num_tokens
                self.stats.hits += computed.num_tokens

    def take_block_ops(self) -> list[BlockOp]:
        """The block operations queued since the last call (copy-on-write copies today), for the
        step record; the storage runs them before the forward."""
        ops = list(self._ops)
        self._ops.clear()  # in place: the tier seam queues write-back saves into the same list
        return ops

    @property
    def has_pending_ops(self) -> bool:
        return bool(self._ops)

    def cache_blocks(self, req: Request) -> None:
        """Make the request's newly completed full blocks findable (prompt and generated tokens)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(req.request_id)
        if not table:
            return
        full = min(req.num_computed_tokens // self.block_size, len(table))
        canonical = self.canonical_tokens(req)
        if canonical is not None:  # KV past it saw a policy's view, not the whole prefix
            full = min(full, canonical // self.block_size)
        done = self._num_cached.get(req.request_id, 0)
        if full <= done:
            return
        hashes, contents = self._block_hashes(req), self._content_hashes(req)
        for i in range(done, full):
            b = table[i]
            if b is None:  # dropped before it was cached (a policy that ran first): nothing to find
                continue
            self.pool.cache(b, hashes[i])
            self.misses.cached(contents[i], hashes[i], req.cache_salt, req.kv_cache_dtype)
            if self.tiers and self.pool.block_hash(b) == hashes[i]:
                parent = hashes[i - 1] if i else request_root(self.root_key, req.kv_cache_dtype, req.cache_salt)
                op = self.tiers.save_op(b, hashes[i], parent)
                if op is not None:
                    self._ops.append(op)
        self._num_cached[req.request_id] = full

    # -- tiers -------------------------------------------------------------------------------
    def expect_remote_history(self) -> None:
        """Sessions restored from records (another instance's, through Redis): their history's
        full blocks may be in the remote tier, which this process cannot list; mark them there so
        the next turn tries to load them (a block that is not there is recomputed)."""
        if "remote" not in self.tiers.index.tiers:
            return
        for s in self.sessions.all():
            if not s.resident:
                root = request_root(self.root_key, None, s.cache_salt)
                self.tiers.index.mark("remote", hash_full_blocks(s.token_ids, self.block_size, root))

    def begin_loading(self, req: Request, computed: ComputedBlocks) -> Loading | None:
        """Start bringing the blocks of ``req``'s prefix that only the tiers hold back into the
        pool (after ``computed``, its pool hits); None when the tiers hold nothing more."""
        if not self.tiers or computed.source not in (BlockSource.PREFIX, BlockSource.NONE):
            return None
        limit = (req.num_tokens - 1) // self.block_size
        hits = self.tiers.hits(self._block_hashes(req), len(computed.blocks), limit)
        if not hits:
            return None
        held_free = sum(1 for b in computed.blocks if b is not None and self.pool.ref_count(b) == 0)
        while self.pool.num_free - held_free < len(hits):  # idle KV makes room, as for a prefill
            if not self._make_room(req):
                break
            held_free = sum(1 for b in computed.blocks if b is not None and self.pool.ref_count(b) == 0)
        return self.tiers.begin(computed.blocks, hits, self._ops)

    def free(self, req: Request) -> None:
        """A request leaves the running set. A finished turn of a session parks its blocks in the
        session (pinned); otherwise every block is returned, tail first, so later blocks are
        evicted before earlier ones."""
        table = self._tables.pop(req.request_id, [])
        num_cached = self._num_cached.pop(req.request_id, 0)
        self._lossy_from.pop(req.request_id, None)  # a preempted request recomputes with all its KV
        self._scores.pop(req.request_id, None)
        session = self.sessions.get(req.session_id) if req.session_id else None
        if req.cache_pins and session is None and req.status in (RequestStatus.FINISHED_STOPPED,
                                                                 RequestStatus.FINISHED_LENGTH):
            self._pin_prefixes(req, table)
        if session is not None and req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            if session.blocks:  # a turn under another salt did not take the session's old blocks
                self.release_session(session)
            self.sessions.end_turn(session, table, req.num_computed_tokens, req.all_token_ids, req.cache_salt)
            self._park_hashes(req, session, num_cached)
        else:
            self._free_held(table)
            if session is not None and req.status.finished:
                self.sessions.abandon_turn(session)
        if req.status.finished:
            self._hashes.pop(req.request_id, None)
            self._contents.pop(req.request_id, None)

    def _pin_prefixes(self, req: Request, table: list[int | None]) -> None:
        """Pin what ``req`` asked for (before its table is freed): :meth:`PrefixPins.pin_request`."""
        if self.enable_prefix_caching:
            root = request_root(self.root_key, req.kv_cache_dtype, req.cache_salt)
            self.pins.pin_request(req, self._block_hashes(req), root, self.block_size, len(table))

    # -- sessions ----------------------------------------------------------------------------
    def begin_turn(self, session_id: str, turn_start: int = 0, tenant: str | None = None) -> Session:
        """Mark a session as serving a turn whose new tokens start at ``turn_start`` (creating it
        if new; a tenant over its session cap forgets its least recently used idle session)."""
        session, forgotten = self.sessions.begin_turn(session_id, turn_start, tenant)
        for old in forgotten:
            self.release_session(old)
        return session

    def release_session(self, session: Session, evicted: bool = False, expired: bool = False) -> None:
        """Give a session's blocks back (its full blocks stay findable in the prefix cache)."""
        self._free_held(self.sessions.drop_blocks(session))
        self._forget_parked(session.session_id)
        self.sessions.stats.evicted += evicted
        self.sessions.stats.expired += expired

    def drop_oldest_turns(self, session: Session, cut: int) -> None:
        """Forget a session's history before token ``cut``; its KV is released (positions shift,
        so what remains is recomputed)."""
        self.release_session(session)
        self.sessions.truncate_front(session, cut)

    def expire_sessions(self) -> int:
        """Release idle sessions past their timeout, forget those past retention. Returns how many
        were released."""
        demote = self.session_demote_after_s
        expired = self.sessions.expired(None if demote is None else min(demote, self.sessions.idle_timeout_s))
        for s in expired:
            self.release_session(s, expired=True)
        for s in self.sessions.past_retention():
            self.release_session(s)
            self.sessions.remove(s.session_id)
            self.sessions.stats.forgotten += 1
        return len(expired)

    def close_session(self, session_id: str) -> bool:
        """Forget a session; its blocks come back now (or when its running turn ends)."""
        session = self.sessions.remove(session_id)
        if session is None:
            return False
        self.release_session(session)
        self.sessions.stats.closed += 1
        return True

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()

    # -- checking ----------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the pool's invariants and that references match tables, session blocks, pins,
        tier loads and peer transfers in flight."""
        self.pool.check()
        tables = [*self._tables.values(), *(s.blocks for s in self.sessions.all())]
        held = sum(1 for t in tables for b in t if b is not None)
        held += self.tiers.held_refs() + self.pins.held_refs() + self.peers.held_refs()
        self.pins.check()
        refs = sum(self.pool.ref_count(b) for b in range(self.pool.num_blocks))
        assert held == refs, f"tables, sessions, loads and transfers hold {held} references; the pool counts {refs}"
