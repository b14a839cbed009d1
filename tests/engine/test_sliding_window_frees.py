"""A windowed model (Mistral) frees the blocks behind its window as a sequence advances, and still
gives transformers' greedy tokens.

The pool in these tests holds fewer tokens than one sequence: without freeing, the request
could not even be admitted. After every step the KV books balance (``check()``) and the blocks in
use never exceed what :func:`kvserve.kv.press.peak_blocks` says (worked out by hand below too).
"""

from __future__ import annotations

import pytest

from kvserve.engine.llm import LLM
from kvserve.kv.press import peak_blocks
from kvserve.sampling_params import SamplingParams

from .conftest import MISTRAL_WINDOW, hf_greedy

WINDOW = MISTRAL_WINDOW
BLOCK = 4
PROMPT = [(7 * i + 3) % 500 + 1 for i in range(70)]  # 70 tokens: more than four windows
NEW = 30


def run_checked(llm: LLM, prompts: list[list[int]], max_steps: int = 3000) -> tuple[list[list[int]], int]:
    """Greedy tokens of each prompt, and the most blocks in use after any step (books checked)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    done, peak = {}, 0
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.kv.check()
        peak = max(peak, engine.kv.usage().used)
    else:
        pytest.fail("unfinished after the step bound")
    assert engine.kv.usage().used == 0
    return [done[i].outputs[0].token_ids for i in ids], peak


def test_peak_blocks_by_hand() -> None:
    # a decode reads 16 keys ending at its own position: a span of 16 positions touches at most
    # 5 blocks of 4; a chunk of 8 reads 16 + 8 - 1 = 23 positions: at most 7 blocks
    assert peak_blocks(100, BLOCK, WINDOW, 1) == 5
    assert peak_blocks(100, BLOCK, WINDOW, 8) == 7
    assert peak_blocks(10, BLOCK, WINDOW, 8) == 3      # shorter than the window: every block
    assert peak_blocks(100, BLOCK, None, 8) == 25       # no window: every block


def test_window_frees_blocks_and_matches_transformers(tiny_mistral, hf_mistral) -> None:
    expected = hf_greedy(hf_mistral, PROMPT, NEW)
    # 8 blocks = 32 tokens, a third of the 100-token sequence; chunks of 8 need at most 7 blocks
    llm = LLM(tiny_mistral, dtype="float32", block_size=BLOCK, num_blocks=8, max_num_batched_tokens=8)
    assert llm.engine.max_model_len == 512  # not lowered to the pool's 32 tokens: the window frees
    tokens, peak = run_checked(llm, [PROMPT])
    assert tokens == [expected]
    assert peak <= peak_blocks(len(PROMPT) + NEW, BLOCK, WINDOW, 8) == 7
    assert llm.engine.kv.dropped_blocks == (len(PROMPT) + NEW - 1 + 1 - WINDOW) // BLOCK  # 21 blocks behind


def test_batch_with_shared_prefix_and_window(tiny_mistral, hf_mistral) -> None:
    """Eight sequences sharing a 40-token prefix, prefix cache and chunked prefill on: each gives
    its own transformers tokens; a prefix block one sequence drops stays with the others."""
    prefix = PROMPT[:40]
    prompts = [prefix + [100 + 11 * j + k for k in range(5 + j)] for j in range(8)]
    expected = [hf_greedy(hf_mistral, p, NEW) for p in prompts]
    llm = LLM(tiny_mistral, dtype="float32", block_size=BLOCK, num_blocks=64, max_num_batched_tokens=32)
    tokens, peak = run_checked(llm, prompts)
    assert tokens == expected
    assert peak <= 64
    assert llm.engine.kv.stats.hits > 0  # the siblings hit the shared prefix


def test_planner_capacity_agrees_with_the_engine(tiny_mistral) -> None:
    """``kvserve plan`` on the windowed model: sequences that fit at once equal the engine's
    budget divided by the blocks one sequence holds at most (its window's blocks)."""
    import json

    from typer.testing import CliRunner

    from kvserve.cli import app

    result = CliRunner().invoke(app, ["plan", "--model", str(tiny_mistral), "--kv-cache-memory", "1MiB",
                                      "--block-size", str(BLOCK), "--max-model-len", "400", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    llm = LLM(tiny_mistral, dtype="float32", block_size=BLOCK, kv_cache_memory="1MiB", max_num_batched_tokens=1,
              max_model_len=400)
    blocks = llm.engine.capacity.num_blocks
    assert plan["num_blocks"] == blocks
    assert plan["engine_log_line"] == llm.engine.capacity.summary()  # concurrency counted the same way
    per_seq = peak_blocks(400, BLOCK, WINDOW, 1)
    assert plan["fit"]["full_length_sequences"] == blocks // per_seq
