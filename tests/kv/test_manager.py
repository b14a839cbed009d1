"""KVCacheManager: block tables, prefix hits with exact block ids, salts, and no leaks."""

from __future__ import annotations

from kvserve.kv.manager import KVCacheManager
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
