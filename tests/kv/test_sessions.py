"""Sessions in the KV manager: pinned blocks between turns, idle expiry, pressure, copy-on-write."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.contract import CopyBlock
from kvserve.kv.manager import BlockSource, KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler

from ..scheduler.fake_runner import FakeRunner, next_token


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def turn(kv: KVCacheManager, rid: str, tokens: list[int], session: str, generated: list[int],
         salt: str | None = None) -> Request:
    """Admit, prefill and decode ``generated`` tokens by hand, checking invariants each mutation."""
    req = Request(rid, list(tokens), SamplingParams(max_tokens=len(generated)), session_id=session, cache_salt=salt)
    computed = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - computed.num_tokens, computed)
    kv.check()
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    for i, tok in enumerate(generated):
        req.append_token(tok)
        if i < len(generated) - 1:  # the last sampled token is never computed
            assert kv.allocate_slots(req, 1)
            req.num_computed_tokens += 1
            kv.cache_blocks(req)
        kv.check()
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)
    kv.check()
    return req


def test_next_turn_reuses_the_whole_history_including_the_partial_block():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv.begin_turn("s")
    first = turn(kv, "t1", [1, 2, 3, 4, 5, 6], "s", [7, 8, 9])  # 9 tokens, 8 computed
    session = kv.sessions.get("s")
    assert session.num_computed == 8 and session.token_ids == first.all_token_ids
    pinned = list(session.blocks)
    assert len(pinned) == 2 and kv.usage().used == 2  # pinned, not freed
    kv.begin_turn("s")
    nxt = Request("t2", first.all_token_ids + [10, 11], SamplingParams(), session_id="s")
    hit = kv.get_computed_blocks(nxt)
    assert hit.source == BlockSource.SESSION and hit.blocks == tuple(pinned) and hit.num_tokens == 8
    assert kv.allocate_slots(nxt, nxt.num_tokens - 8, hit)
    kv.check()
    assert kv.block_table("t2")[:2] == pinned and not session.blocks


def test_idle_timeout_releases_blocks_to_the_prefix_cache():
    clock = Clock()
    kv = KVCacheManager(num_blocks=16, block_size=4, session_idle_timeout_s=60, clock=clock)
    kv.begin_turn("s")
    first = turn(kv, "t1", list(range(10)), "s", [50, 51])
    clock.t += 59
    assert kv.expire_sessions() == 0 and kv.sessions.get("s").resident
    clock.t += 2
    assert kv.expire_sessions() == 1
    kv.check()
    assert kv.usage().used == 0 and kv.sessions.stats.expired == 1
    # the history is kept; its full blocks are still found in the prefix cache
    kv.begin_turn("s")
    nxt = Request("t2", first.all_token_ids + [60], SamplingParams(), session_id="s")
    hit = kv.get_computed_blocks(nxt)
    assert hit.source == BlockSource.PREFIX and hit.num_tokens == 8


def test_close_session_frees_everything():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.begin_turn("s")
    turn(kv, "t1", list(range(7)), "s", [9])
    assert kv.close_session("s") and not kv.close_session("s")
    kv.check()
    assert kv.usage().used == 0 and "s" not in kv.sessions


def test_one_turn_at_a_time():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.begin_turn("s")
    with pytest.raises(ValueError, match="already serving a turn"):
        kv.begin_turn("s")


def test_pressure_takes_free_cache_first_then_idle_sessions_lru():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    for sid, base in (("old", 100), ("new", 200)):
        kv.begin_turn(sid)
        turn(kv, f"{sid}-1", list(range(base, base + 5)), sid, [1, 2])  # 6 computed -> 2 blocks each
    assert kv.usage().used == 4
    # 2 free blocks: a 2-block request needs no session released
    a = Request("a", list(range(8)), SamplingParams())
    assert kv.allocate_slots(a, 8)
    assert kv.sessions.get("old").resident and kv.sessions.get("new").resident
    # one more block: the least recently used session goes first
    b = Request("b", [7, 7, 7], SamplingParams())
    assert kv.allocate_slots(b, 3)
    kv.check()
    assert not kv.sessions.get("old").resident and kv.sessions.get("new").resident
    assert kv.sessions.stats.evicted == 1


def test_scheduler_under_pressure_never_fails_sessions_or_requests():
    """Interleaved session turns and one-off requests on a tiny pool all finish with the
    reference tokens; sessions get evicted and recomputed instead of failing."""
    bs = 2
    kv = KVCacheManager(num_blocks=14, block_size=bs)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8), kv, max_model_len=64)
    runner = FakeRunner(bs)
    histories = {"s1": [], "s2": []}
    for round_ in range(4):
        reqs = []
        for sid, hist in histories.items():
            kv.begin_turn(sid)
            r = Request(f"{sid}-{round_}", hist + [round_ + 1, 3], SamplingParams(max_tokens=3), session_id=sid)
            sched.add_request(r)
            reqs.append(r)
        other = Request(f"o-{round_}", [40 + round_] * 9, SamplingParams(max_tokens=3))
        sched.add_request(other)
        reqs.append(other)
        while sched.has_unfinished:
            plan = sched.schedule()
            kv.check()
            sched.update(plan, runner.execute(plan))
            kv.check()
        for r in reqs:
            seq = list(r.prompt_token_ids)
            for _ in range(3):
                seq.append(next_token(seq))
            assert r.all_token_ids == seq
            if r.session_id:
                histories[r.session_id] = r.all_token_ids
    assert kv.sessions.stats.evicted > 0
    for sid in histories:
        kv.close_session(sid)
    kv.check()
    assert kv.usage().used == 0


def test_copy_on_write_keeps_the_other_sharers_tokens():
    """n=3 samples share every prompt block of the first, including the partial last one; each
    sibling copies that block before writing, so the leader's KV is untouched."""
    bs = 4
    kv = KVCacheManager(num_blocks=32, block_size=bs)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, max_model_len=64)
    runner = FakeRunner(bs)
    prompt = list(range(1, 11))  # 10 tokens: blocks of 4, 4, 2
    params = SamplingParams(max_tokens=5)
    leader = Request("g#0", prompt, params, group_id="g")
    sibs = [Request(f"g#{i}", prompt, params, group_id="g", sample_index=i, leader=leader) for i in (1, 2)]
    for r in (leader, *sibs):
        sched.add_request(r)
    copies = 0
    while sched.has_unfinished:
        plan = sched.schedule()
        copies += sum(1 for op in plan.block_ops if isinstance(op, CopyBlock))
        kv.check()
        sched.update(plan, runner.execute(plan))
        kv.check()
    assert copies == 2  # one partial block per sibling
    assert kv.stats.hits == 2 * 9  # each sibling recomputed only the last prompt token
    seq = list(prompt)
    for _ in range(5):
        seq.append(next_token(seq))
    for r in (leader, *sibs):
        assert r.all_token_ids == seq
    assert kv.usage().used == 0
