"""The prompt-caching API in the engine: a ``cache_control`` prefix stays in the pool through
traffic that would evict it, until its TTL (pushed back by every hit) passes; ``prompt_cache_key``
keeps one prompt per key; pins give way to memory pressure instead of failing a request; the
ledger splits cache writes from cache reads. Accounting is checked after every request."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from tests.engine.conftest import write_tiny_llama

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SYSTEM = list(range(100, 132))  # 32 tokens: 8 blocks of 4
FILLERS = [list(range(1000 + 70 * i, 1060 + 70 * i)) for i in range(3)]  # each fills most of the pool


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("pins") / "m")


def engine(model: Path) -> tuple[LLM, Clock]:
    llm = LLM(str(model), dtype="float32", num_blocks=24, block_size=4, num_threads=1)
    clock = Clock()
    llm.engine.kv.pins.clock = clock
    return llm, clock


def ask(llm: LLM, ids: list[int], **kw):  # type: ignore[no-untyped-def]
    eng = llm.engine
    rid = eng.add_request({"prompt_token_ids": ids}, GREEDY, **kw)
    out = next(o for o in eng.run_until_done() if o.request_id == rid)
    eng.kv.check()
    return out


def test_a_pinned_prefix_survives_traffic_that_evicts_an_unpinned_one(model: Path) -> None:
    llm, _ = engine(model)
    first = ask(llm, SYSTEM + [7, 8, 9], cache_control=[(32, 300.0)])
    assert first.cache_write_tokens == 32 and first.num_cached_tokens == 0
    for f in FILLERS:
        ask(llm, f)
    again = ask(llm, SYSTEM + [10, 11])
    assert again.num_cached_tokens == 32 and again.cache_write_tokens == 0  # a read, no write
    assert again.outputs[0].token_ids == ask(engine(model)[0], SYSTEM + [10, 11]).outputs[0].token_ids

    control, _ = engine(model)  # the same traffic without the pin: the prefix is evicted
    ask(control, SYSTEM + [7, 8, 9])
    for f in FILLERS:
        ask(control, f)
    assert ask(control, SYSTEM + [10, 11]).num_cached_tokens == 0


def test_the_ttl_expires_unless_a_hit_refreshes_it(model: Path) -> None:
    llm, clock = engine(model)
    pins = llm.engine.kv.pins
    ask(llm, SYSTEM + [1], cache_control=[(32, 300.0)])
    clock.t += 250
    assert ask(llm, SYSTEM + [2]).num_cached_tokens == 32  # a hit: the deadline moves to +300 from now
    clock.t += 250
    ask(llm, [5, 6, 7])  # a step runs expiry: still pinned (refreshed 250 s ago)
    assert len(pins) == 1 and pins.stats.refreshed >= 1
    clock.t += 301
    ask(llm, [5, 6, 8])
    assert len(pins) == 0 and pins.stats.expired == 1 and pins.held_refs() == 0


def test_prompt_cache_key_keeps_the_latest_prompt_of_each_key(model: Path) -> None:
    llm, _ = engine(model)
    pins = llm.engine.kv.pins
    ask(llm, SYSTEM[:16] + [1, 2, 3, 4], prompt_cache_key="agent-a")
    assert pins.held_refs() == 5
    ask(llm, SYSTEM[:24] + [9, 9, 9, 9], prompt_cache_key="agent-a")  # replaces the first
    assert len(pins) == 1 and pins.held_refs() == 7
    ask(llm, SYSTEM[:8], prompt_cache_key="agent-b")
    assert len(pins) == 2
    other_tenant = ask(llm, SYSTEM[:24] + [9, 9, 9, 9], cache_salt="tenant-x")
    assert other_tenant.num_cached_tokens == 0  # another salt never reads these pins


def test_pins_give_way_to_memory_pressure(model: Path) -> None:
    llm, _ = engine(model)
    pins = llm.engine.kv.pins
    ask(llm, SYSTEM + [1], cache_control=[(32, 3600.0)])
    big = ask(llm, list(range(2000, 2088)))  # 88 + 4 tokens: 23 of the 24 blocks
    assert big.outputs[0].finish_reason == "length" and len(big.outputs[0].token_ids) == 4
    assert len(pins) == 0 and pins.stats.evicted == 1


def test_bad_pins_are_refused_before_anything_is_queued(model: Path) -> None:
    llm, _ = engine(model)
    eng = llm.engine
    for kw in ({"cache_control": [(0, 300.0)]}, {"cache_control": [(99, 300.0)]},
               {"cache_control": [(4, 300.0)] * 5}, {"prompt_cache_key": ""}):
        with pytest.raises(ValueError):
            eng.add_request({"prompt_token_ids": SYSTEM}, GREEDY, **kw)
    with pytest.raises(ValueError, match="session"):
        eng.add_request({"prompt_token_ids": SYSTEM}, GREEDY, session_id="s", cache_control=[(8, 300.0)])
    assert not eng.has_unfinished_requests()
