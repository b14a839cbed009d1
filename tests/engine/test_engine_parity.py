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
    assert greedy(llm) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leak(llm)


def test_block_size_one_and_prefix_hits_keep_tokens(tiny_llama, expected):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", block_size=4, max_num_seqs=1)
    first = greedy(llm)
    again = greedy(llm)  # every prompt now hits its cached blocks
    assert first == expected and again == expected
    assert llm.engine.kv.stats.hits > 0
    assert_no_leak(llm)
