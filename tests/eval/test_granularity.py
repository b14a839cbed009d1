"""The token-vs-block reference: its masks keep what they say, and hiding the needle hides it."""

from __future__ import annotations

import torch

from kvserve.eval.granularity import answer, keep_mask
from kvserve.eval.retrieval import load_heldout, shipped_retrieval_model


def test_keep_mask_counts_tokens_or_whole_blocks() -> None:
    scores = torch.zeros(64)
    scores[[10, 40, 41]] = torch.tensor([5.0, 3.0, 3.0])
    tok = keep_mask(scores, 4 + 4 + 3, sinks=4, recent=4, block_size=None)
    assert tok.sum() == 11 and tok[[0, 3, 10, 40, 41, 60, 63]].all() and not tok[11]
    blk = keep_mask(scores, 48, sinks=4, recent=4, block_size=16)
    assert blk.tolist() == [True] * 16 + [False] * 16 + [True] * 32  # sink block, block of 40-41, recent block


def test_hiding_the_needle_hides_it() -> None:
    from transformers import AutoModelForCausalLM

    path = shipped_retrieval_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    examples = load_heldout(path, 8)
    context = len(examples[0].prompt) - 1
    full = hidden = 0
    for ex in examples:
        ids = torch.tensor([ex.prompt])
        keep = torch.ones(context, dtype=torch.bool)
        full += answer(model, ids, context, keep) == ex.answer
        pos = ex.needle_position
        keep[pos:pos + 2] = False
        hidden += answer(model, ids, context, keep) == ex.answer
    assert full >= 7 and hidden <= 2
