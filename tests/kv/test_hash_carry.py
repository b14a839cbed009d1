"""A session turn's block hashes carried to its next turn (kvserve/kv/hash_carry.py).

Each turn must (a) leave every full computed block of the history findable under the hash a
fresh request with those tokens computes, (b) keep every reference accounted for, and (c) make
findable only the blocks it completed itself: a turn's bookkeeping is O(its new tokens), not
O(history) (before the carry, every turn re-hashed and re-cached the whole history).
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.manager import BlockSource, KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

from .test_sessions import turn

BS = 4
_ids = itertools.count()


class Counting(KVCacheManager):
    """Counts ``pool.cache`` calls: the blocks a turn walks through ``cache_blocks``."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.cached_calls = 0
        real = self.pool.cache

        def cache(b: int, h: bytes) -> None:
            self.cached_calls += 1
            real(b, h)

        self.pool.cache = cache  # type: ignore[method-assign]


def run_turn(kv: KVCacheManager, history: list[int], new: list[int], generated: list[int],
             salt: str | None = None) -> tuple[Request, BlockSource]:
    """One turn of session ``s`` (prefill of ``history + new``, then ``generated`` decoded, the
    invariants checked after each mutation) and where its computed KV came from."""
    kv.begin_turn("s")
    rid = f"r{next(_ids)}"
    source = kv.get_computed_blocks(Request(rid, history + new, SamplingParams(), session_id="s",
                                            cache_salt=salt)).source
    return turn(kv, rid, history + new, "s", generated, salt), source


def findable_blocks(kv: KVCacheManager, tokens: list[int], salt: str | None) -> int:
    """Full blocks of ``tokens`` a fresh request (no session) finds in the prefix cache."""
    probe = Request(f"probe{next(_ids)}", list(tokens) + [0], SamplingParams(), cache_salt=salt)
    return kv.get_computed_blocks(probe).num_tokens // BS


def test_each_turn_caches_only_the_blocks_it_completed():
    kv = Counting(num_blocks=256, block_size=BS)
    history: list[int] = []
    for t in range(12):
        before = kv.cached_calls
        full_before = max(len(history) - 1, 0) // BS  # made findable by earlier turns (the last token has no KV)
        req, source = run_turn(kv, history, [100 + t] * 5, [200 + t, 201 + t, 202 + t])
        history = req.all_token_ids
        full_after = (len(history) - 1) // BS
        assert source is (BlockSource.SESSION if t else BlockSource.NONE)
        assert kv.cached_calls - before == full_after - full_before  # the whole history before the carry
        assert findable_blocks(kv, history, None) == full_after


def test_a_released_session_or_another_salt_takes_no_carry_and_stays_findable():
    kv = Counting(num_blocks=256, block_size=BS)
    req, _ = run_turn(kv, [], list(range(9)), [50, 51, 52])
    kv.release_session(kv.sessions.get("s"))  # its blocks go back: the carry must not outlive them
    assert not kv._parked
    req, source = run_turn(kv, req.all_token_ids, [60, 61, 62, 63], [70, 71])
    assert source is BlockSource.PREFIX
    # a turn under another salt does not take the session's blocks (nor their hashes)
    history = req.all_token_ids
    req, source = run_turn(kv, history, [80, 81], [90, 91, 92], salt="tenant-b")
    assert source is not BlockSource.SESSION
    assert findable_blocks(kv, req.all_token_ids, "tenant-b") == (len(req.all_token_ids) - 1) // BS
    assert findable_blocks(kv, history, None) == (len(history) - 1) // BS


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 6), st.sampled_from(["turn", "release", "salt"])),
                min_size=1, max_size=10))
def test_turns_releases_and_salts_keep_every_block_findable(steps):
    kv = Counting(num_blocks=512, block_size=BS)
    history: list[int] = []
    salt: str | None = None
    for n_new, n_gen, action in steps:
        if action == "release" and kv.sessions.get("s") is not None and kv.sessions.get("s").resident:
            kv.release_session(kv.sessions.get("s"))
            kv.check()
        if action == "salt":
            salt = None if salt else "other"
        new = [len(history) + i for i in range(n_new)]
        req, _ = run_turn(kv, history, new, [7] * n_gen, salt)
        history = req.all_token_ids
        assert findable_blocks(kv, history, salt) == (len(history) - 1) // BS
