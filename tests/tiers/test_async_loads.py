"""Tier loads do not stall the step: while one request's blocks are read from a (deliberately
slow) remote tier, a real Redis, other requests are admitted, decode and finish; the loading
request then runs on the loaded KV with the tokens of an uncached run. A request that ends
mid-load leaves its target blocks held until the reads report, then every block comes back. A
step with nothing but loads from a local tier reads them on the step's own thread. Accounting is
checked after every step."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvserve import LLM
from kvserve.request import RequestStatus
from tests.engine.conftest import write_tiny_llama
from tests.tiers.test_engine_tiers import GREEDY, A, evict_a, run

OTHER = {"prompt_token_ids": list(range(3000, 3010))}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("async") / "m")


def gated(llm: LLM) -> threading.Event:
    """Make the remote tier's reads wait for the returned event (the loader thread blocks)."""
    tier = llm.engine.runner.tiers.tiers[0]
    assert tier.name == "remote"
    gate, read = threading.Event(), tier.read

    def slow_read(key: bytes) -> bytes | None:
        assert gate.wait(30), "test gate never opened"
        return read(key)

    tier.read = slow_read
    return gate


def step(llm: LLM) -> list:  # type: ignore[type-arg]
    outs = llm.engine.step()
    llm.engine.kv.check()
    return outs


def step_until(llm: LLM, rid: str, done: dict, limit: int) -> None:  # type: ignore[type-arg]
    """Step (at most ``limit`` times) until ``rid`` finished; finished outputs collect in ``done``."""
    for _ in range(limit):
        for out in step(llm):
            if out.finished:
                done[out.request_id] = out
        if rid in done:
            return


def primed(model: Path, **tier: str) -> LLM:
    llm = LLM(str(model), dtype="float32", num_blocks=24, block_size=4, num_threads=1, **tier)  # type: ignore[arg-type]
    run(llm, A)
    evict_a(llm)  # A's blocks now live in the tier only
    return llm


def test_other_requests_run_to_completion_while_a_load_is_in_flight(model: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    reference = run(LLM(str(model), dtype="float32", num_blocks=24, block_size=4, num_threads=1), A)[0]
    other_reference = run(LLM(str(model), dtype="float32", num_blocks=24, block_size=4, num_threads=1), OTHER)[0]
    llm = primed(model, kv_remote=redis_server.url)
    gate = gated(llm)
    eng = llm.engine
    a = eng.add_request(A, GREEDY)
    step(llm)  # A's loads are queued and block in the tier
    assert eng.scheduler.loading and eng.kv.tiers.loads_in_flight > 0
    b = eng.add_request(OTHER, GREEDY)
    done: dict = {}  # type: ignore[type-arg]
    step_until(llm, b, done, 50)
    assert b in done and a not in done  # B was served start to finish while A's KV was loading
    assert done[b].outputs[0].token_ids == other_reference
    assert all(r.status == RequestStatus.LOADING for r, _ in eng.scheduler.loading.values())
    gate.set()
    step_until(llm, a, done, 200)
    out = done[a]
    assert out.outputs[0].token_ids == reference
    assert out.kv_hit_tokens.get("remote", 0) >= 14 * 4 - 4
    c = eng.kv.tiers.index.counters["remote"]
    assert c.loads >= 13 and sum(c.load_buckets) == c.loads and c.hits >= c.loads and c.misses >= 1


def test_a_request_aborted_mid_load_returns_every_block(model: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    llm = primed(model, kv_remote=redis_server.url)
    gate = gated(llm)
    eng = llm.engine
    a = eng.add_request(A, GREEDY)
    step(llm)
    held = eng.kv.tiers.held_refs()
    assert held > 0 and eng.kv.tiers.loads_in_flight > 0
    eng.abort_request(a)
    assert not eng.scheduler.loading and eng.kv.tiers.held_refs() == held  # targets still being written
    assert eng.has_unfinished_requests()  # the engine keeps stepping until the reads report
    gate.set()
    for _ in range(50):
        step(llm)
        if not eng.has_unfinished_requests():
            break
    assert eng.kv.tiers.loads_in_flight == 0 and eng.kv.tiers.held_refs() == 0
    assert eng.kv.usage().used == 0  # every block back (the loaded ones cached-free, findable)
    tokens, hits, _ = run(llm, A)
    assert hits.get("pool", 0) >= 14 * 4 - 4 and tokens  # what was loaded serves the next request


def test_an_idle_step_reads_local_tiers_on_its_own_thread(model: Path) -> None:
    reference = run(LLM(str(model), dtype="float32", num_blocks=24, block_size=4, num_threads=1), A)[0]
    llm = primed(model, kv_host_memory="8MiB")
    tier, readers = llm.engine.runner.tiers.tiers[0], set()
    read = tier.read

    def watched(key: bytes) -> bytes | None:
        readers.add(threading.current_thread().name)
        return read(key)

    tier.read = watched
    tokens, hits, _ = run(llm, A)
    assert tokens == reference and hits.get("host", 0) >= 14 * 4 - 4
    assert threading.main_thread().name in readers  # nothing else ran: no hand-off to the loader thread


def test_a_tier_that_raises_is_a_miss_not_a_failed_request(model: Path) -> None:
    reference = run(LLM(str(model), dtype="float32", num_blocks=24, block_size=4, num_threads=1), A)[0]
    llm = primed(model, kv_host_memory="8MiB")
    tier = llm.engine.runner.tiers.tiers[0]

    def broken(key: bytes) -> bytes | None:
        raise OSError("disk on fire")

    tier.read = broken
    tokens, hits, _ = run(llm, A)
    assert tokens == reference and hits.get("host", 0) == 0  # recomputed
