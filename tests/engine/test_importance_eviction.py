"""SnapKV- and H2O-style block eviction with continuous batching, chunked prefill and the prefix
cache on: eight requests sharing a prefix, books checked after every step, the shared prefix
blocks never dropped (exact ids), and requests without a policy unchanged (transformers' tokens).
"""

from __future__ import annotations

from kvserve.engine.llm import LLM
from kvserve.kv.press import PressSpec
from kvserve.sampling_params import SamplingParams

from .conftest import hf_greedy

BLOCK, NEW = 4, 12
PREFIX = [(17 * i + 9) % 4000 + 3 for i in range(24)]  # 6 shared blocks
POLICIES = [PressSpec("snapkv", ratio=0.5, sink_tokens=4, recent_tokens=8, observe_tokens=8)] * 3 + \
           [PressSpec("h2o", ratio=0.5, sink_tokens=4, recent_tokens=8)] * 3 + [None, None]


def test_policies_at_batch_eight_with_a_shared_prefix(tiny_llama, hf_tiny_llama) -> None:
    prompts = [PREFIX + [(31 * j + 7 * i) % 4000 + 5 for i in range(20 + j)] for j in range(8)]
    plain = [j for j, p in enumerate(POLICIES) if p is None]
    expected = {j: hf_greedy(hf_tiny_llama, prompts[j], NEW) for j in plain}
    llm = LLM(tiny_llama, dtype="float32", block_size=BLOCK, num_blocks=256, max_num_batched_tokens=32)
    engine, kv = llm.engine, llm.engine.kv
    scored_steps: list[set[str]] = []
    run = engine.runner.execute

    def spy(plan):  # which requests had block scores computed
        out = run(plan)
        scored_steps.append(set(out.block_scores or {}))
        return out

    engine.runner.execute = spy  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params, kv_press=press) for p, press in zip(prompts, POLICIES)]
    prefix_ids: list[int] | None = None
    done = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
        kv.check()  # every reference accounted for after each mutation
        tables = {rid: kv.block_table(rid) for rid in ids if kv.block_table(rid)}
        if prefix_ids is None and len(tables) == len(ids):
            prefix_ids = tables[ids[0]][:len(PREFIX) // BLOCK]
        if prefix_ids is not None:
            for t in tables.values():  # the shared prefix blocks: never dropped, never copied
                assert t[:len(prefix_ids)] == prefix_ids
    assert not engine.has_unfinished_requests() and kv.usage().used == 0
    assert prefix_ids is not None and all(b is not None for b in prefix_ids)  # all eight ran together
    for j in plain:
        assert done[ids[j]].outputs[0].token_ids == expected[j]
    assert kv.dropped_blocks > 0
    scored = set().union(*scored_steps)
    assert scored == {ids[j] for j, p in enumerate(POLICIES) if p is not None}  # no scores where none asked
