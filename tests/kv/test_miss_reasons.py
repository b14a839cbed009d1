"""Why a prompt's tokens were recomputed: each missed token gets exactly one reason.

Block size 4, a 10-token prompt: 2 full blocks a lookup can return (``(10 - 1) // 4``) and 2 tail
tokens that are always computed (``partial_block``). Every result sums to the missed tokens.
"""

from __future__ import annotations

from kvserve.kv.manager import KVCacheManager
from kvserve.kv.miss_ledger import MissLedger
from kvserve.kv.press import PressSpec
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams

PROMPT = list(range(10))


def make(rid: str, tokens: list[int], salt: str | None = None, codec: str | None = None,
         press: PressSpec | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt, kv_cache_dtype=codec,
                   kv_press=press)


def admit_run_finish(kv: KVCacheManager, req: Request) -> dict[str, int]:
    """Admit (reasons taken at admission, as the scheduler does), compute, cache, finish."""
    computed = kv.get_computed_blocks(req)
    reasons = kv.miss_reasons(req, computed)
    assert sum(reasons.values()) == req.num_tokens - computed.num_tokens
    assert kv.allocate_slots(req, req.num_tokens - computed.num_tokens, computed)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    kv.forget(req)
    kv.check()
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)
    kv.check()
    return reasons


def test_never_seen_then_only_the_tail() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    assert admit_run_finish(kv, make("a", PROMPT)) == {"never_seen": 8, "partial_block": 2}
    assert admit_run_finish(kv, make("b", PROMPT)) == {"partial_block": 2}


def test_other_salt_and_other_codec_are_told_apart_from_never_seen() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit_run_finish(kv, make("a", PROMPT, salt="tenant-1"))
    assert admit_run_finish(kv, make("b", PROMPT, salt="tenant-2")) == {"different_salt": 8, "partial_block": 2}
    assert admit_run_finish(kv, make("c", PROMPT, salt="tenant-1", codec="int8")) == {
        "different_codec": 8, "partial_block": 2}


def test_evicted_by_the_pool_policy() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    admit_run_finish(kv, make("a", PROMPT))                      # 3 blocks, 2 cached
    admit_run_finish(kv, make("filler", list(range(100, 116))))  # 4 blocks: reuses a's
    assert admit_run_finish(kv, make("b", PROMPT)) == {"evicted:lru": 8, "partial_block": 2}


def test_a_block_behind_a_missing_one_takes_its_reason() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit_run_finish(kv, make("a", PROMPT))
    changed = [99] + PROMPT[1:]  # the first block differs: the second, though cached, is unreachable
    assert admit_run_finish(kv, make("b", changed)) == {"never_seen": 8, "partial_block": 2}


def test_a_sinks_request_computes_its_own_kv_past_its_canonical_boundary() -> None:
    """W + S = 6: only positions 0-5 hold KV any request would compute; its later blocks are its
    own (``dropped_window``) and never cached, so a later plain request cannot find them either."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    press = PressSpec("sinks", sink_tokens=2, window_tokens=4)
    admit_run_finish(kv, make("plain", PROMPT))
    assert admit_run_finish(kv, make("s", PROMPT, press=press)) == {"dropped_window": 4, "partial_block": 2}
    kv2 = KVCacheManager(num_blocks=16, block_size=4)
    admit_run_finish(kv2, make("s", PROMPT, press=press))
    assert admit_run_finish(kv2, make("plain", PROMPT)) == {"never_seen": 4, "partial_block": 2}


def test_a_block_a_tier_failed_to_load_is_named() -> None:
    """The tiers held both full blocks but the first load failed: both are recomputed for that."""
    ledger = MissLedger()
    hashes, contents = [b"h0" * 16, b"h1" * 16], [b"c0" * 16, b"c1" * 16]
    got = ledger.classify(10, 0, 4, hashes, contents, None, None, lambda h: False, failed=frozenset(hashes))
    assert got == {"tier_load_failed": 8, "partial_block": 2}
