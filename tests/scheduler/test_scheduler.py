"""Scheduler: continuous batching, chunked prefill, preemption by recompute, admission limits.

Every test checks the KV invariants after every step and that every block is back at the end.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler

from .fake_runner import FakeRunner, next_token, run_checked


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def run(prompts: list[list[int]], max_tokens: list[int], num_blocks: int, block_size: int = 4,
        budget: int = 16, max_seqs: int = 8, prefix: bool = True, max_model_len: int = 256,
        chunked: bool = True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                      enable_chunked_prefill=chunked), kv, max_model_len)
    runner = FakeRunner(block_size)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0)) for i, (p, m) in
            enumerate(zip(prompts, max_tokens))]
    for r in reqs:
        sched.add_request(r)
    def after(plan):  # type: ignore[no-untyped-def]
        assert plan.num_batched_tokens <= budget
        assert len({c.request_id for c in plan.chunks}) == len(plan.chunks) <= max_seqs
        assert_exact_tables(kv, reqs)

    run_checked(sched, runner, after)
    assert kv.usage().used == 0, "blocks leaked"
    return reqs, sched, runner


def assert_exact_tables(kv: KVCacheManager, reqs: list[Request]) -> None:
    """A running request holds exactly the blocks its computed tokens need; any other holds none
    (a preempted request gave everything back and recomputes from token 0)."""
    for r in reqs:
        table = kv.block_table(r.request_id)
        if r.status == RequestStatus.RUNNING:
            assert len(table) == kv.blocks_needed(r.num_computed_tokens), (r.request_id, r.num_computed_tokens, table)
        else:
            assert table == [], (r.request_id, r.status, table)


def drive(sched: Scheduler, runner: FakeRunner, steps: int) -> None:
    for _ in range(steps):
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
        sched.kv.check()


def test_batch_matches_each_request_alone():
    prompts = [[1, 2, 3], list(range(20, 37)), [5] * 9, list(range(60, 61))]
    max_tokens = [5, 8, 3, 10]
    reqs, _, _ = run(prompts, max_tokens, num_blocks=64)
    for r, p, m in zip(reqs, prompts, max_tokens):
        assert r.output_token_ids == reference(p, m)
        assert r.status == RequestStatus.FINISHED_LENGTH


def test_long_prompt_is_chunked_and_decodes_keep_running():
    short = [1, 2, 3]
    long = list(range(100, 140))  # 40 tokens, budget 8 -> several chunks
    reqs, _, runner = run([short, long], [20, 2], num_blocks=64, budget=8)
    assert reqs[0].output_token_ids == reference(short, 20)
    assert reqs[1].output_token_ids == reference(long, 2)
    assert max(runner.batched_tokens) <= 8
    # the short request decoded while the long prompt was still being prefilled
    assert runner.steps < 2 + 40 // 7 + 20


def test_small_pool_preempts_and_still_gives_identical_tokens():
    prompts = [list(range(i * 10, i * 10 + 7)) for i in range(6)]
    reqs, sched, _ = run(prompts, [12] * 6, num_blocks=10, block_size=4, budget=32)
    assert sched.num_preemptions > 0
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == reference(p, 12)


def test_preemption_with_prefix_caching_off():
    prompts = [list(range(i * 10, i * 10 + 7)) for i in range(5)]
    reqs, sched, _ = run(prompts, [10] * 5, num_blocks=8, prefix=False)
    assert sched.num_preemptions > 0
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == reference(p, 10)


def test_shared_prefix_hits_and_same_tokens():
    system = list(range(200, 216))  # 4 full blocks
    prompts = [system + [i] for i in range(4)]
    reqs, sched, _ = run(prompts, [4] * 4, num_blocks=64, budget=64, max_seqs=1)
    assert sched.kv.stats.hits == 3 * 16  # every later request hits the whole system prompt
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == reference(p, 4)


def test_admission_rejects_what_can_never_fit():
    kv = KVCacheManager(4, 4)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(Request("a", list(range(30)), SamplingParams(max_tokens=5)))
    with pytest.raises(ValueError, match="never fit the KV pool"):
        sched.add_request(Request("b", list(range(10)), SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("c", [], SamplingParams()))
    assert not sched.has_unfinished and kv.usage().used == 0


def test_finish_request_returns_blocks_while_running_or_waiting():
    kv = KVCacheManager(16, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1), kv, max_model_len=64)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8))
    b = Request("b", [6, 7], SamplingParams(max_tokens=8))
    sched.add_request(a)
    sched.add_request(b)
    plan = sched.schedule()
    sched.update(plan, FakeRunner(4).execute(plan))
    assert kv.usage().used > 0
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    kv.check()
    assert kv.usage().used == 0 and not sched.has_unfinished


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=6),
    max_tokens=st.integers(min_value=1, max_value=12),
    num_blocks=st.integers(min_value=11, max_value=40),
    budget=st.integers(min_value=1, max_value=48),
    max_seqs=st.integers(min_value=1, max_value=6),
    prefix=st.booleans(),
    block_size=st.sampled_from([1, 2, 4]),
    chunked=st.booleans(),
)
def test_any_workload_finishes_with_reference_tokens_and_no_leak(lens, max_tokens, num_blocks, budget,
                                                                 max_seqs, prefix, block_size, chunked):
    # Prompts share prefixes (so hits happen) and every request fits the pool on its own.
    prompts = [[(j * 7) % 13 for j in range(n)] for n in lens]
    if max(lens) + max_tokens > num_blocks * block_size:
        num_blocks = -(-(max(lens) + max_tokens) // block_size)
    if not chunked:  # unchunked, every request must be computable in one step (admission says so)
        budget = max(budget, max(lens) + max_tokens)
    reqs, _, _ = run(prompts, [max_tokens] * len(prompts), num_blocks=num_blocks, block_size=block_size,
                     budget=budget, max_seqs=max_seqs, prefix=prefix, chunked=chunked)
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == reference(p, max_tokens)


def test_preempted_request_recomputes_from_zero_in_a_pool_that_fits_one():
    """Five blocks of 4 hold one 7 + 12 token request, not two: the newer one is preempted, and
    re-admitted with a table sized for its tokens alone (a stale computed count would ask for more
    blocks than the pool has and wait forever)."""
    prompts = [list(range(1, 8)), list(range(30, 37))]
    for prefix in (True, False):
        reqs, sched, _ = run(prompts, [12, 12], num_blocks=5, prefix=prefix, budget=32)
        assert sched.num_preemptions > 0
        assert any(r.num_preemptions > 0 for r in reqs)
        for r, p in zip(reqs, prompts):
            assert r.output_token_ids == reference(p, 12)


def test_preemption_gives_back_every_block_and_the_computed_count():
    kv = KVCacheManager(5, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32), kv, max_model_len=64)
    runner = FakeRunner(4)
    old, new = (Request(rid, list(range(k, k + 7)), SamplingParams(max_tokens=12)) for rid, k in (("a", 1), ("b", 30)))
    sched.add_request(old)
    sched.add_request(new)
    for _ in range(100):
        plan = sched.schedule()
        if plan.preempted:
            break
        sched.update(plan, runner.execute(plan))
    else:
        pytest.fail("the pool never ran short")
    assert plan.preempted == ["b"] and new.status == RequestStatus.PREEMPTED
    assert new.num_computed_tokens == 0 and kv.block_table("b") == []
    assert len(new.output_token_ids) > 0  # its tokens so far are kept, to be recomputed
    kv.check()


def test_aborting_a_queued_session_turn_ends_the_turn_and_lets_the_session_expire():
    now = [0.0]
    kv = KVCacheManager(32, 4, session_idle_timeout_s=10.0, clock=lambda: now[0])
    sched = Scheduler(SchedulerConfig(max_num_seqs=1), kv, max_model_len=64, clock=lambda: now[0])
    runner = FakeRunner(4)
    kv.begin_turn("s")
    first = Request("t1", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=2), session_id="s")
    sched.add_request(first)
    drive(sched, runner, 5)
    session = kv.sessions.get("s")
    assert first.status.finished and session.resident and not session.busy
    blocker = Request("blocker", [40, 41, 42], SamplingParams(max_tokens=30))
    sched.add_request(blocker)
    drive(sched, runner, 2)
    kv.begin_turn("s")
    second = Request("t2", first.all_token_ids + [7, 8], SamplingParams(max_tokens=2), session_id="s")
    sched.add_request(second)
    drive(sched, runner, 2)
    assert second.status == RequestStatus.WAITING  # max_num_seqs=1: the blocker runs
    sched.finish_request("t2", RequestStatus.FINISHED_ABORTED)
    kv.check()
    assert not session.busy and session.resident  # the turn ended; the history's KV stays parked
    assert sched.num_waiting == 0
    sched.finish_request("blocker", RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished
    now[0] += 11.0  # past the idle timeout: a free session is released at the next step
    sched.schedule()
    kv.check()
    assert not session.resident and kv.usage().used == 0
    kv.begin_turn("s")  # and it can serve a new turn


def test_aborting_a_preempted_waiting_request_leaves_nothing_behind():
    kv = KVCacheManager(5, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32), kv, max_model_len=64)
    runner = FakeRunner(4)
    sched.add_request(Request("a", list(range(1, 8)), SamplingParams(max_tokens=12)))
    sched.add_request(Request("b", list(range(30, 37)), SamplingParams(max_tokens=12)))
    while not sched.num_preemptions:
        drive(sched, runner, 1)
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert sched.num_waiting == 0 and "b" not in sched.requests
    drive(sched, runner, 30)
    assert not sched.has_unfinished and kv.usage().used == 0


def test_unchunked_prefill_rejects_what_cannot_run_in_one_step():
    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=False), kv, 256)
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\).*max_num_batched_tokens \(16\).*chunked prefill"):
        sched.add_request(Request("long", list(range(20)), SamplingParams(max_tokens=4)))
    # the prompt fits but a recompute after preemption (prompt + generated) would not
    with pytest.raises(ValueError, match=r"= 18 exceeds max_num_batched_tokens \(16\)"):
        sched.add_request(Request("grows", list(range(14)), SamplingParams(max_tokens=4)))
    assert not sched.has_unfinished
    chunked = Scheduler(SchedulerConfig(max_num_batched_tokens=16), KVCacheManager(64, 4), 256)
    chunked.add_request(Request("long", list(range(20)), SamplingParams(max_tokens=4)))  # chunks: fine


def test_unchunked_prefill_with_preemption_finishes():
    prompts = [list(range(i * 20, i * 20 + 6)) for i in range(4)]
    for prefix in (True, False):
        reqs, sched, _ = run(prompts, [10] * 4, num_blocks=9, budget=16, prefix=prefix, chunked=False)
        assert sched.num_preemptions > 0
        for r, p in zip(reqs, prompts):
            assert r.output_token_ids == reference(p, 10)
