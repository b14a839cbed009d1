"""Speculative decoding in the scheduler, against the fake runner that verifies drafts the way
the model runner does: tokens equal a run without drafts, block tables stay exact after every
step, a rejected draft's slot is never hashed, nothing leaks, big batches get no drafts."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig, SpeculativeConfig
from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler

from .fake_runner import FakeRunner, next_token, slots_for
from .test_scheduler import assert_exact_tables


def copier(period: int):
    """A "model" that repeats its context with the given period (drafts from history are right),
    except every 7th position of the output, where it writes a fresh token (drafts are wrong)."""
    def rule(context: list[int]) -> int:
        if len(context) % 7 == 0:
            return 100 + len(context) % 50
        return context[-period] if len(context) >= period else 1
    return rule


def assert_hashed_blocks_hold_accepted_tokens(kv: KVCacheManager, runner: FakeRunner, reqs: list[Request]) -> None:
    """Every block of a live request that the prefix cache can find holds that request's own
    (accepted) tokens: no rejected draft ever became findable."""
    bs = kv.block_size
    for r in reqs:
        for i, b in enumerate(kv.block_table(r.request_id)):
            if kv.pool.block_hash(b) is not None:
                assert i < r.num_computed_tokens // bs
                stored = [runner.store[s] for s in slots_for([b], range(bs), bs)]
                assert stored == r.all_token_ids[i * bs:(i + 1) * bs], (r.request_id, i)


def run(prompts: list[list[int]], max_tokens: int, rule, spec: SpeculativeConfig | None, num_blocks: int = 64,
        block_size: int = 4, budget: int = 64, max_seqs: int = 8, draft_rule=None):
    kv = KVCacheManager(num_blocks, block_size)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                             speculative=spec or SpeculativeConfig())
    sched = Scheduler(config, kv, max_model_len=512)
    runner = FakeRunner(block_size, rule, draft_rule)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0)) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    plans = []
    for _ in range(10_000):
        if not sched.has_unfinished:
            break
        plan = sched.schedule()
        plans.append(plan)
        kv.check()
        assert plan.num_batched_tokens <= budget
        sched.update(plan, runner.execute(plan))
        kv.check()
        assert_exact_tables(kv, reqs)
        assert_hashed_blocks_hold_accepted_tokens(kv, runner, reqs)
    else:
        pytest.fail("livelock")
    assert kv.usage().used == 0, "blocks leaked"
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    return reqs, sched, runner, plans


PROMPTS = [[3, 4, 5, 6, 7, 8] * 3, [9, 10, 11] * 5 + [12], list(range(20, 33))]
NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=5)


@pytest.mark.parametrize("rule", [copier(6), copier(3), next_token], ids=["period6", "period3", "hash"])
def test_drafted_tokens_equal_plain_decoding_with_exact_blocks(rule):
    plain, _, plain_runner, _ = run(PROMPTS, 30, rule, None)
    spec, sched, runner, plans = run(PROMPTS, 30, rule, NGRAM)
    for a, b in zip(plain, spec):
        assert a.output_token_ids == b.output_token_ids
    stats = sched.drafter.stats
    assert stats.verifies == sum(1 for p in plans for c in p.chunks if c.num_sample > 1)
    assert stats.proposed == sum(c.num_sample - 1 for p in plans for c in p.chunks)
    assert stats.accepted == sum(a for _, a in runner.verified)
    if rule is not next_token:  # the copier repeats: drafts are accepted, and some rejected
        assert 0 < stats.accepted < stats.proposed
        assert runner.steps < plain_runner.steps


def test_prefix_cache_hits_after_drafting_are_the_accepted_tokens():
    """A second request resending the first's prompt + output hits its blocks and still matches."""
    rule = copier(6)
    [first], _, _, _ = run([PROMPTS[0]], 25, rule, NGRAM)
    follow = first.all_token_ids + [1, 2]
    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, speculative=NGRAM), kv, 512)
    runner = FakeRunner(4, rule)
    reqs = [Request("a", list(PROMPTS[0]), SamplingParams(max_tokens=25, temperature=0)),
            Request("b", follow, SamplingParams(max_tokens=10, temperature=0))]
    sched.add_request(reqs[0])
    while sched.has_unfinished:
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
    sched.add_request(reqs[1])
    while sched.has_unfinished:
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
        assert_hashed_blocks_hold_accepted_tokens(kv, runner, reqs)
    alone, _, _, _ = run([follow], 10, rule, None)
    assert reqs[1].num_cached_tokens == (len(first.all_token_ids) - 1) // 4 * 4  # the first computed all but its last
    assert reqs[1].output_token_ids == alone[0].output_token_ids
    kv.check()
    assert kv.usage().used == 0


def test_no_drafts_while_more_requests_run_than_the_speculative_limit():
    prompts = [[5, 6, 7] * 4 for _ in range(4)]
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, max_num_seqs=2)
    _, _, _, plans = run(prompts, 12, copier(3), spec)
    for plan in plans:
        if len(plan.chunks) > 2:
            assert all(c.num_sample <= 1 for c in plan.chunks)


def test_drafts_never_pass_max_tokens_and_never_preempt():
    """Slots for drafts come from free blocks only: a pool that fits the requests without drafts
    never preempts because of them, and no verify writes past prompt + max_tokens."""
    prompts = [[5, 6, 7] * 4, [8, 9] * 6]
    reqs, sched, _, plans = run(prompts, 9, copier(3), NGRAM, num_blocks=12)
    assert sched.num_preemptions == 0
    limit = {r.request_id: r.num_prompt_tokens + 9 for r in reqs}
    assert any(c.num_sample > 1 for p in plans for c in p.chunks)
    for plan in plans:
        for c in plan.chunks:
            assert c.end <= limit[c.request_id] - 1


@pytest.mark.parametrize("period", [6, 3], ids=["agrees", "disagrees"])
def test_model_drafts_are_placeholders_the_runner_fills(period):
    """Method "draft": the scheduler sends placeholders and their count (``model_drafts``), the
    runner's draft model fills them; the tokens are plain decoding's, blocks exact, nothing
    rejected is hashed (``run`` checks both every step)."""
    rule = copier(6)
    plain, _, _, _ = run(PROMPTS, 30, rule, None)
    spec = SpeculativeConfig("draft", num_speculative_tokens=5, draft_model="unused-by-the-scheduler")
    drafted, sched, runner, plans = run(PROMPTS, 30, rule, spec, draft_rule=copier(period))
    assert [r.output_token_ids for r in drafted] == [r.output_token_ids for r in plain]
    verifies = [c for p in plans for c in p.chunks if c.num_sample > 1]
    assert verifies and all(c.model_drafts == c.num_sample - 1 for c in verifies)
    assert all(c.new_token_ids[-c.model_drafts:] == [-1] * c.model_drafts for c in verifies)
    assert all(c.model_drafts == 0 for p in plans for c in p.chunks if c.num_sample <= 1)
    stats = sched.drafter.stats
    assert stats.accepted == sum(a for _, a in runner.verified)
    if period == 6:  # the draft is the model's own rule: every draft is right
        assert stats.accepted == stats.proposed > 0
    else:
        assert stats.accepted < stats.proposed
