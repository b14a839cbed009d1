"""The scheduler with KV that forgets: any workload of requests under the model's window or a
sinks policy (mixed with plain ones, sharing prefixes) finishes with the reference tokens, the
books balanced after every step, no dropped block ever read or written (the fake runner asserts
it), and every running request holding no more blocks than ``peak_blocks`` allows."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.press import PressSpec
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler

from .fake_runner import FakeRunner, next_token, run_checked, visible


def reference(prompt: list[int], max_tokens: int, window: int | None, sinks: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token([seq[k] for k in visible(len(seq), window, sinks)]))
    return seq[len(prompt):]


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=6),
    policies=st.lists(st.booleans(), min_size=6, max_size=6),
    max_tokens=st.integers(min_value=1, max_value=16),
    model_window=st.sampled_from([None, 6, 9]),
    sinks=st.integers(min_value=0, max_value=5),
    window=st.integers(min_value=1, max_value=12),
    budget=st.integers(min_value=1, max_value=32),
    block_size=st.sampled_from([1, 2, 4]),
    prefix=st.booleans(),
)
def test_forgetting_workloads_finish_with_reference_tokens(lens, policies, max_tokens, model_window, sinks,
                                                           window, budget, block_size, prefix):
    kv = KVCacheManager(64, block_size, enable_prefix_caching=prefix, sliding_window=model_window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget), kv, 256)
    runner = FakeRunner(block_size)
    press = PressSpec("sinks", sink_tokens=sinks, window_tokens=window)
    prompts = [[(j * 7) % 13 for j in range(n)] for n in lens]
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0),
                    kv_press=press if policies[i] else None) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    def bounded(plan):  # type: ignore[no-untyped-def]
        for r in reqs:
            if r.status == RequestStatus.RUNNING:
                assert kv.num_held_blocks(r.request_id) <= kv.peak_blocks(r.kv_press, r.num_tokens, budget)

    run_checked(sched, runner, bounded)
    assert not sched.has_unfinished and kv.usage().used == 0
    for r, p in zip(reqs, prompts):
        w, s = kv.window_of(r)
        assert r.output_token_ids == reference(p, max_tokens, w, s), (r.request_id, w, s)
