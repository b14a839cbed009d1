"""KVCacheManager: block tables, prefix hits with exact block ids, salts, and no leaks."""

from __future__ import annotations

from kvserve.kv.manager import BlockSource, KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams


def make_req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def finish(kv: KVCacheManager, req: Request) -> None:
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)
    kv.check()


def run_prefill(kv: KVCacheManager, req: Request) -> None:
    computed = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - computed.num_tokens, computed)
    kv.check()
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    kv.check()


def test_block_table_grows_by_whole_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_req("a", list(range(6)))
    assert kv.allocate_slots(req, 6)
    kv.check()
    assert kv.block_table("a") == [0, 1]
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 2)  # tokens 6, 7 fit in block 1
    assert kv.block_table("a") == [0, 1]
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1)
    assert kv.block_table("a") == [0, 1, 2]
    kv.check()
    finish(kv, req)
    assert kv.usage().used == 0


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = make_req("a", list(range(12)))
    assert not kv.allocate_slots(req, 12)
    kv.check()
    assert kv.block_table("a") == [] and kv.usage().used == 0


def test_prefix_hit_reuses_exact_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(10)))  # blocks: [0..3] [4..7] [8, 9]
    run_prefill(kv, a)
    table_a = kv.block_table("a")
    finish(kv, a)
    b = make_req("b", list(range(9)) + [99])  # shares the first two full blocks
    hit = kv.get_computed_blocks(b)
    assert hit.blocks == tuple(table_a[:2]) and hit.num_tokens == 8
    # A prompt that is exactly cached still computes its last token: 8 tokens -> 1 block hit.
    c = make_req("c", list(range(8)))
    assert kv.get_computed_blocks(c).num_tokens == 4


def test_generated_tokens_are_cached_for_the_next_turn():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", [1, 2, 3])
    run_prefill(kv, a)
    for tok in (4, 5, 6):  # decode: append then compute
        a.append_token(tok)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        kv.cache_blocks(a)
        kv.check()
    table = kv.block_table("a")
    finish(kv, a)
    nxt = make_req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(nxt).blocks == (table[0],)


def test_salt_isolates_tenants():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(9)), salt="tenant-a")
    run_prefill(kv, a)
    finish(kv, a)
    assert kv.get_computed_blocks(make_req("b", list(range(9)), salt="tenant-b")).num_tokens == 0
    assert kv.get_computed_blocks(make_req("c", list(range(9)))).num_tokens == 0
    assert kv.get_computed_blocks(make_req("d", list(range(9)), salt="tenant-a")).num_tokens == 8


def test_shared_prefix_is_held_once_and_survives_one_sharer_leaving():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(9)))
    run_prefill(kv, a)
    b = make_req("b", list(range(8)) + [50, 51])
    run_prefill(kv, b)
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.usage().used == 4  # 2 shared + 1 tail each
    finish(kv, a)
    assert kv.usage().used == 3
    finish(kv, b)
    assert kv.usage().used == 0 and kv.usage().cached_free == 2  # the two full shared blocks


def test_lru_evicts_the_oldest_freed_cached_block_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    old = make_req("old", [1, 2, 3])
    run_prefill(kv, old)
    finish(kv, old)          # caches block [1, 2]
    new = make_req("new", [5, 6, 7])
    run_prefill(kv, new)
    finish(kv, new)          # caches block [5, 6]
    filler = make_req("f", [9, 9, 9, 9, 9])  # needs 3 blocks: 2 uncached... then the oldest cached
    assert kv.allocate_slots(filler, 5)
    kv.check()
    assert kv.get_computed_blocks(make_req("x", [1, 2, 0])).num_tokens == 0  # evicted
    assert kv.get_computed_blocks(make_req("y", [5, 6, 0])).num_tokens == 2  # still cached


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_req("a", list(range(9)))
    run_prefill(kv, a)
    finish(kv, a)
    assert kv.get_computed_blocks(make_req("b", list(range(9)))).num_tokens == 0
    assert kv.usage().cached_free == 0


def test_every_completed_block_is_cached_exactly_when_it_fills():
    """After ``k`` computed tokens exactly ``k // block_size`` blocks are findable, including when
    ``k`` is a multiple of the block size (the block just filled)."""
    bs = 4
    tokens = list(range(1, 14))
    for k in range(1, len(tokens) + 1):
        kv = KVCacheManager(num_blocks=8, block_size=bs)
        a = make_req("a", tokens)
        assert kv.allocate_slots(a, k)
        a.num_computed_tokens = k
        kv.cache_blocks(a)
        kv.check()
        table = kv.block_table("a")
        finish(kv, a)
        assert kv.usage().cached_free == k // bs, k
        probe = make_req("p", tokens + [99])
        hit = kv.get_computed_blocks(probe)
        assert hit.blocks == tuple(table[:k // bs]) and hit.num_tokens == k // bs * bs, k


def test_prompt_of_whole_blocks_is_fully_reusable_by_a_longer_one():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(8)))  # exactly two blocks
    run_prefill(kv, a)
    finish(kv, a)
    b = make_req("b", list(range(8)) + [50, 51, 52])
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 8 and hit.source == BlockSource.PREFIX


def test_reset_prefix_cache_drops_hits_and_keeps_blocks_of_running_requests():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(9)))
    run_prefill(kv, a)
    finish(kv, a)
    assert kv.get_computed_blocks(make_req("x", list(range(9)))).num_tokens == 8
    assert kv.reset_prefix_cache() == 2
    kv.check()
    assert kv.get_computed_blocks(make_req("y", list(range(9)))).num_tokens == 0
    assert kv.usage().cached_free == 0 and kv.usage().used == 0


def _turn(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None) -> Request:
    """One session turn through the manager: begin, take the computed prefix, prefill, finish."""
    kv.begin_turn("s")
    req = Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt, session_id="s")
    computed = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - computed.num_tokens, computed)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    kv.check()
    finish(kv, req)
    return req


def test_session_blocks_are_not_reused_across_salts():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = list(range(1, 11))
    _turn(kv, "t1", first, salt="tenant-a")
    assert kv.sessions.get("s").resident
    nxt = first + [20, 21]
    other = Request("t2", nxt, SamplingParams(max_tokens=4), cache_salt="tenant-b", session_id="s")
    hit = kv.get_computed_blocks(other)
    assert hit.num_tokens == 0 and hit.blocks == ()  # neither the session's blocks nor tenant a's cache
    unsalted = Request("t3", nxt, SamplingParams(max_tokens=4), session_id="s")
    assert kv.get_computed_blocks(unsalted).num_tokens == 0
    same = Request("t4", nxt, SamplingParams(max_tokens=4), cache_salt="tenant-a", session_id="s")
    hit = kv.get_computed_blocks(same)
    assert hit.source == BlockSource.SESSION and hit.num_tokens == 10


def test_a_turn_with_another_salt_leaks_nothing_and_parks_its_own_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    _turn(kv, "t1", list(range(1, 11)), salt="tenant-a")
    _turn(kv, "t2", list(range(1, 13)), salt="tenant-b")  # recomputed, not taken from the session
    session = kv.sessions.get("s")
    assert session.num_computed == 12 and len(session.blocks) == 3
    nxt = Request("t3", list(range(1, 15)), SamplingParams(max_tokens=4), cache_salt="tenant-b", session_id="s")
    assert kv.get_computed_blocks(nxt).source == BlockSource.SESSION
    assert kv.close_session("s")
    kv.check()
    assert kv.usage().used == 0
