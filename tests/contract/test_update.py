"""``Scheduler.update`` reads a RunnerOutput: several accepted tokens are appended in order and the
request stops at the first stop condition; a failed request ends alone and returns its blocks."""

from __future__ import annotations

from kvserve.config import SchedulerConfig
from kvserve.contract import RunnerOutput, SampledTokens
from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler


def setup(params: SamplingParams, eos: tuple[int, ...] = ()) -> tuple[Scheduler, Request, KVCacheManager]:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, max_model_len=64)
    req = Request("r", [1, 2, 3, 4, 5], params, eos_token_ids=eos)
    sched.add_request(req)
    return sched, req, kv


def test_several_tokens_are_appended_and_a_stop_token_ends_them() -> None:
    sched, req, kv = setup(SamplingParams(max_tokens=10, stop_token_ids=(9,)))
    plan = sched.schedule()
    assert plan.new_requests[0].request_id == "r" and plan.chunks[0].new_token_ids == [1, 2, 3, 4, 5]
    sched.update(plan, RunnerOutput(sampled={"r": SampledTokens([6, 7, 9, 8])}))
    assert req.output_token_ids == [6, 7, 9] and req.status is RequestStatus.FINISHED_STOPPED
    assert req.stop_reason == 9 and kv.usage().used == 0
    kv.check()


def test_eos_and_max_tokens_cut_a_multi_token_step() -> None:
    sched, req, _ = setup(SamplingParams(max_tokens=10), eos=(2,))
    plan = sched.schedule()
    sched.update(plan, RunnerOutput(sampled={"r": SampledTokens([6, 2, 7])}))
    assert req.output_token_ids == [6, 2] and req.status is RequestStatus.FINISHED_STOPPED
    sched, req, _ = setup(SamplingParams(max_tokens=2))
    plan = sched.schedule()
    sched.update(plan, RunnerOutput(sampled={"r": SampledTokens([6, 7, 8])}))
    assert req.output_token_ids == [6, 7] and req.status is RequestStatus.FINISHED_LENGTH


def test_extra_tokens_are_told_to_the_runner_next_step_and_kv_is_only_counted_where_computed() -> None:
    sched, req, _ = setup(SamplingParams(max_tokens=10))
    plan = sched.schedule()
    sched.update(plan, RunnerOutput(sampled={"r": SampledTokens([6, 7, 8])}))
    # one position sampled: KV exists for the 5 prompt tokens only; the 3 new tokens are computed next
    assert req.num_computed_tokens == 5 and req.output_token_ids == [6, 7, 8]
    nxt = sched.schedule()
    assert not nxt.new_requests and nxt.chunks[0].start == 5 and nxt.chunks[0].num_new_tokens == 3
    assert nxt.chunks[0].new_token_ids == [6, 7, 8]


def test_a_failed_request_ends_alone_with_its_error_and_blocks_back() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, max_model_len=64)
    a, b = (Request(rid, [1, 2, 3], SamplingParams(max_tokens=4)) for rid in ("a", "b"))
    sched.add_request(a)
    sched.add_request(b)
    plan = sched.schedule()
    sched.update(plan, RunnerOutput(sampled={"b": SampledTokens([5])}, failed={"a": "ValueError('bad')"}))
    assert a.status is RequestStatus.FINISHED_ERROR and a.error == "ValueError('bad')" and a.finish_reason.value == "error"
    assert b.status is RequestStatus.RUNNING and b.output_token_ids == [5]
    assert kv.block_table("a") == [] and kv.usage().used == 1
    kv.check()
    # the runner is told to forget the failed request on the next step
    assert "a" in sched.schedule().finished
