"""Attention sinks + window (StreamingLLM) per request, against a straightforward reference.

The reference is transformers itself, recomputing the whole sequence at every step with a 4-D
mask that lets query ``q`` see key ``k`` iff ``k <= q`` and (``k > q - W`` or ``k < S``): original
positions, no re-rotation, token-exact. The engine must give the same greedy tokens while it
frees every block outside the sinks and the window, in a batch with a shared prefix, chunked
prefill and the prefix cache on, and leave other requests (no policy) exactly as they were.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.llm import LLM
from kvserve.kv.press import PressSpec, peak_blocks
from kvserve.sampling_params import SamplingParams

from .conftest import hf_greedy

SINKS, WINDOW, BLOCK, NEW = 4, 10, 4, 20
PRESS = PressSpec("sinks", sink_tokens=SINKS, window_tokens=WINDOW)
PREFIX = [(13 * i + 5) % 4000 + 3 for i in range(30)]


def reference_sinks_greedy(hf_model, prompt: list[int], new: int, sinks: int, window: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            n = len(ids)
            q = torch.arange(n)[:, None]
            k = torch.arange(n)[None, :]
            allowed = (k <= q) & ((k > q - window) | (k < sinks))
            logits = hf_model(torch.tensor([ids]), attention_mask=allowed[None, None]).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def run_checked(llm: LLM, jobs: list[tuple[list[int], PressSpec | None]]) -> tuple[list[list[int]], int]:
    engine = llm.engine
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params, kv_press=press) for p, press in jobs]
    done, peak = {}, 0
    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.kv.check()
        peak = max(peak, engine.kv.usage().used)
    assert not engine.has_unfinished_requests()
    assert engine.kv.usage().used == 0
    return [done[i].outputs[0].token_ids for i in ids], peak


def test_reference_mask_differs_from_full_attention(hf_tiny_llama) -> None:
    """The case is sharp: sinks + window changes the tokens, so equality below means something."""
    assert reference_sinks_greedy(hf_tiny_llama, PREFIX, NEW, SINKS, WINDOW) != hf_greedy(hf_tiny_llama, PREFIX, NEW)


def test_sinks_window_matches_reference_in_bounded_blocks(tiny_llama, hf_tiny_llama) -> None:
    expected = reference_sinks_greedy(hf_tiny_llama, PREFIX, NEW, SINKS, WINDOW)
    chunk = 6
    # a 50-token sequence (13 blocks) holds at most 6 at once: the policy frees as it goes
    limit = peak_blocks(len(PREFIX) + NEW, BLOCK, WINDOW, chunk, SINKS)
    assert limit == 1 + 5  # the sink block + ceil((10 + 6 - 2) / 4) + 1 window blocks
    llm = LLM(tiny_llama, dtype="float32", block_size=BLOCK, num_blocks=13, max_num_batched_tokens=chunk)
    tokens, peak = run_checked(llm, [(PREFIX, PRESS)])
    assert tokens == [expected]
    assert peak <= limit


def test_batch_of_eight_with_shared_prefix_policy_per_request(tiny_llama, hf_tiny_llama) -> None:
    """Four requests with the policy, four without, all sharing a 30-token prefix: each gets its own
    reference's tokens (the policy never leaks into a neighbour sharing its prefix blocks)."""
    prompts = [PREFIX + [50 + 7 * j + i for i in range(3 + j)] for j in range(8)]
    jobs = [(p, PRESS if j % 2 == 0 else None) for j, p in enumerate(prompts)]
    expected = [reference_sinks_greedy(hf_tiny_llama, p, NEW, SINKS, WINDOW) if press else
                hf_greedy(hf_tiny_llama, p, NEW) for p, press in jobs]
    llm = LLM(tiny_llama, dtype="float32", block_size=BLOCK, num_blocks=128, max_num_batched_tokens=16)
    tokens, _ = run_checked(llm, jobs)
    assert tokens == expected
    assert llm.engine.kv.stats.hits > 0


def test_a_dropped_shared_block_stays_with_its_other_holder(tiny_llama) -> None:
    """A request under the policy drops prefix blocks another running request shares: exactly those
    block ids stay in the other's table, with one reference each."""
    llm = LLM(tiny_llama, dtype="float32", block_size=BLOCK, num_blocks=64, max_num_batched_tokens=64)
    engine, kv = llm.engine, llm.engine.kv
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    plain = engine.add_request({"prompt_token_ids": PREFIX + [1, 2]}, params)
    engine.step()  # the plain request prefills; its prefix blocks are cached
    shared = [b for b in kv.block_table(plain)[:len(PREFIX) // BLOCK]]
    windowed = engine.add_request({"prompt_token_ids": PREFIX + [3, 4]}, params, kv_press=PRESS)
    engine.step()
    kv.check()
    table = kv.block_table(windowed)
    dropped = [i for i, b in enumerate(table) if b is None]
    assert dropped == list(range(1, (len(PREFIX) + 2 + 1 - WINDOW) // BLOCK))  # all but the sink block
    assert kv.block_table(plain)[:len(shared)] == shared                      # the same ids, untouched
    assert all(kv.pool.ref_count(shared[i]) == 1 for i in dropped)            # only the plain one holds them
    assert table[0] == shared[0] and kv.pool.ref_count(shared[0]) == 2         # the sink block is shared still
    llm.engine.run_until_done()
    kv.check()


def test_session_overflow_window_keeps_kv_bounded(tiny_llama) -> None:
    """``session_overflow="window"``: a conversation past ``max_session_tokens`` keeps running, its
    KV bounded by sinks + window, with no recompute of the history (the turn hits the session)."""
    cap = 24
    llm = LLM(tiny_llama, dtype="float32", block_size=BLOCK, num_blocks=64, max_session_tokens=cap,
              session_overflow="window")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    held = []
    for turn in range(6):
        out = llm.generate({"prompt_token_ids": [100 + turn * 9 + i for i in range(9)]}, params, session_id="s")
        assert len(out[0].outputs[0].token_ids) == 6
        llm.engine.kv.check()
        held.append(sum(1 for b in llm.engine.kv.sessions.get("s").blocks if b is not None))
        if turn >= 2:
            assert out[0].num_cached_tokens > 0  # the history's KV was reused, not recomputed
    session = llm.engine.kv.sessions.get("s")
    assert len(session.token_ids) == 6 * 15  # nothing forgotten from the history itself
    assert max(held) <= peak_blocks(10**6, BLOCK, cap - 4, 64, 4)
    with pytest.raises(ValueError, match="session_overflow"):
        LLM(tiny_llama, dtype="float32", num_blocks=8, session_overflow="forget")
