"""End-to-end engine against transformers: batched, chunked and preempted runs give the same
greedy tokens as transformers' ``generate`` on each prompt alone (fp32, random weights)."""

from __future__ import annotations

import pytest

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

from .conftest import hf_greedy

PROMPTS = [
    [5, 17, 300, 42],
    list(range(100, 150)),          # 50 tokens: several blocks, several chunks
    [7],                            # a one-token prompt
    list(range(1000, 1023)),
]
NEW = 24


@pytest.fixture(scope="module")
def expected(hf_tiny_llama):
    return [hf_greedy(hf_tiny_llama, p, NEW) for p in PROMPTS]


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def greedy_stepped(llm: LLM, max_steps: int = 2000) -> list[list[int]]:
    """``greedy`` through ``add_request``/``step`` with a step bound, so a request that can never
    be (re)admitted fails the test instead of hanging it."""
    engine = llm.engine
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in PROMPTS]
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
    else:
        pytest.fail(f"still unfinished after {max_steps} steps: running {engine.scheduler.num_running}, "
                    f"waiting {engine.scheduler.num_waiting}")
    return [done[i].outputs[0].token_ids for i in ids]


def assert_no_leak(llm: LLM) -> None:
    llm.engine.kv.check()
    assert llm.engine.kv.usage().used == 0


def test_batch_of_mixed_lengths_matches_each_alone(tiny_llama, expected):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=512)
    assert greedy(llm) == expected
    assert_no_leak(llm)


def test_chunked_prefill_matches_whole_prefill(tiny_llama, expected):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=7)
    assert greedy(llm) == expected
    assert_no_leak(llm)


def test_pool_too_small_for_the_batch_preempts_and_matches(tiny_llama, expected):
    # 6 blocks of 16 = 96 tokens: enough for the longest request (74) alone, not for all four.
    llm = LLM(tiny_llama, dtype="float32", num_blocks=6, block_size=16, enable_prefix_caching=False)
    assert greedy_stepped(llm) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leak(llm)


def test_block_size_one_and_prefix_hits_keep_tokens(tiny_llama, expected):
    # kv_quant_sink_tokens=0: the default (4, an int4 setting) is refused for blocks under 4 tokens
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", block_size=1, max_num_seqs=1,
              kv_quant_sink_tokens=0)
    assert llm.engine.capacity.block_size == 1
    first = greedy(llm)
    assert first == expected
    assert llm.engine.kv.stats.hits == 0  # the four prompts share no first token
    again = greedy(llm)  # every prompt now hits all its tokens but the last, one block per token
    assert again == expected
    assert llm.engine.kv.stats.hits == sum(len(p) - 1 for p in PROMPTS) == 3 + 49 + 0 + 22
    assert_no_leak(llm)


def test_prefix_hit_counts_equal_the_full_blocks_of_the_shared_prefix(tiny_llama):
    """Block size 4, one request at a time: a prompt's full blocks are cached once computed, so a
    repeat hits ``(len - 1) // 4 * 4`` tokens and a longer prompt over the same tokens hits them all."""
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", block_size=4, max_num_seqs=1)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)  # ends right after its prefill
    base = list(range(600, 624))  # 24 tokens: six full blocks
    outs = [llm.generate({"prompt_token_ids": p}, params)[0] for p in (base, base, base + [1, 2, 3], base[:9])]
    assert [o.num_cached_tokens for o in outs] == [0, 20, 24, 8]
    assert_no_leak(llm)
