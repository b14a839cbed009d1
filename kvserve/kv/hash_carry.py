"""A request's block hashes, and a session turn's carried to the session's next turn.

A mixin of :class:`kvserve.kv.manager.KVCacheManager`. No torch.

Each request's full blocks are hashed twice (the salted chain that the prefix cache finds them
by, and the miss ledger's content chain: :mod:`kvserve.kv.hashing`), lazily and extended as its
tokens grow; ``cache_blocks`` makes the blocks past ``_num_cached`` findable. A session's next
turn is a new request over the same history. Without a carry it hashed the whole history again
and walked every block of it through ``cache_blocks``: O(history) Python on each turn, 1.9 ms of
manager calls in turn 37's first step at 3,500 tokens of history (benchmarks/session_bookkeeping.py).
So a turn that parks its blocks in its session also parks its hash chains and how many blocks it
made findable, and the next turn that takes those blocks takes them too: a turn's bookkeeping is
O(its new tokens).

Invariant: a parked entry is used only while the session still holds the very block list the
turn parked (list identity: a release, eviction, truncation, import or another turn replaces the
list), under the same salt and KV codec, for a prompt that starts with the parked tokens. The
carried chains are then exactly the chains the request would compute, and the carried count
names blocks that were made findable (still held by the session since, so never evicted).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv.hashing import BlockHash, hash_full_blocks, request_root
from kvserve.kv.sessions import Session
from kvserve.request import Request


@dataclass(frozen=True)
class ParkedHashes:
    blocks: list[int | None]  # the session's parked block list: its identity is the check
    tokens: list[int]         # the tokens the chains cover a prefix of
    salt: str | None
    codec: str | None
    hashes: list[BlockHash]
    contents: list[BlockHash]
    num_cached: int           # leading blocks made findable


class HashCarry:
    block_size: int
    root_key: BlockHash
    _content_root: BlockHash
    _hashes: dict[str, list[BlockHash]]
    _contents: dict[str, list[BlockHash]]
    _parked: dict[str, ParkedHashes]

    def _block_hashes(self, req: Request) -> list[BlockHash]:
        """Chained hashes of ``req``'s full blocks under its salt and codec (extended as it grows)."""
        known = self._hashes.get(req.request_id)
        if known is None or len(known) < req.num_tokens // self.block_size:
            root = request_root(self.root_key, req.kv_cache_dtype, req.cache_salt)
            known = self._hashes[req.request_id] = hash_full_blocks(req.all_token_ids, self.block_size, root, known)
        return known

    def _content_hashes(self, req: Request) -> list[BlockHash]:
        """Chained hashes of ``req``'s full blocks' tokens alone (no salt, no codec)."""
        known = self._contents.get(req.request_id)
        if known is None or len(known) < req.num_tokens // self.block_size:
            known = self._contents[req.request_id] = hash_full_blocks(req.all_token_ids, self.block_size,
                                                                      self._content_root, known)
        return known

    def _park_hashes(self, req: Request, session: Session, num_cached: int) -> None:
        """``req`` (a finished turn) just parked its blocks in ``session``: keep its chains."""
        self._parked[session.session_id] = ParkedHashes(
            session.blocks, session.token_ids, req.cache_salt, req.kv_cache_dtype,
            self._hashes.get(req.request_id, []), self._contents.get(req.request_id, []), num_cached)

    def _parked_for(self, req: Request, session: Session) -> ParkedHashes | None:
        p = self._parked.get(session.session_id)
        if p is None or p.blocks is not session.blocks or p.salt != req.cache_salt or p.codec != req.kv_cache_dtype:
            return None
        n = len(p.tokens)
        return p if len(req.prompt_token_ids) >= n and req.prompt_token_ids[:n] == p.tokens else None

    def _seed_from_session(self, req: Request, session: Session) -> None:
        """``req`` will take ``session``'s blocks: start its chains from the parked ones."""
        p = self._parked_for(req, session)
        if p is not None:
            self._hashes.setdefault(req.request_id, list(p.hashes))
            self._contents.setdefault(req.request_id, list(p.contents))

    def _carried_cached(self, req: Request, session: Session) -> int:
        """Leading blocks of ``session``'s parked list already findable (0 without an entry);
        the entry is consumed: the blocks move to ``req``."""
        p = self._parked_for(req, session)
        self._parked.pop(session.session_id, None)
        return p.num_cached if p is not None else 0

    def _forget_parked(self, session_id: str) -> None:
        self._parked.pop(session_id, None)
