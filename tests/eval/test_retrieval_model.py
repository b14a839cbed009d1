"""The shipped retrieval model tells eviction policies apart: it answers its held-out prompts
with full KV, kvserve's logits match transformers' on them, and losing the needle makes it guess."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.eval import retrieval_task as rt
from kvserve.eval.kv_quality import EvalConfig, make_engine, teacher_forced_logprobs
from kvserve.eval.retrieval import (
    RetrievalSet,
    load_heldout,
    needle_drops,
    retrieval_accuracy,
    shipped_retrieval_model,
)
from kvserve.kv.press import PressSpec

N, CHUNK = 32, 64


@pytest.fixture(scope="module")
def rs() -> RetrievalSet:
    path = shipped_retrieval_model()
    assert path is not None, "kvserve-tiny-retrieval is not shipped"
    examples = tuple(load_heldout(path, N))
    cfg = EvalConfig(model=str(path), texts=N, max_tokens=len(examples[0].prompt) + 2, greedy_prompts=0)
    return RetrievalSet(make_engine(cfg, "auto"), examples)


def test_heldout_set_is_well_formed(rs: RetrievalSet) -> None:
    for ex in rs.examples:
        keys = [k for _, k, _ in ex.needles]
        assert len(set(keys)) == len(keys)
        pos, key, value = ex.needles[ex.asked]
        assert ex.prompt[pos] == key and ex.prompt[pos + 1] == value == ex.answer
        assert ex.prompt[-2:] == [rt.QUERY_ID, key] and ex.prompt.count(key) == 2
    assert len(rs.examples[0].prompt) >= 1024 and rs.context == len(rs.examples[0].prompt) - 1


def test_full_kv_answers_the_heldout_slice(rs: RetrievalSet) -> None:
    assert retrieval_accuracy(rs, None, CHUNK) >= 0.9
    assert rs.engine.kv.usage().used == 0


def test_logits_match_transformers(rs: RetrievalSet) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(shipped_retrieval_model(), dtype=torch.float32).eval()
    prompts = [ex.prompt for ex in rs.examples[:2]]
    ours = teacher_forced_logprobs(rs.engine, prompts, chunk=CHUNK)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor(prompts)).logits.float(), -1)
    for i in range(len(prompts)):
        torch.testing.assert_close(ours[i], ref[i], atol=2e-4, rtol=1e-4)


def test_tokenizer_round_trips_the_words(rs: RetrievalSet) -> None:
    tok = rs.engine.tokenizer
    ids = rs.examples[0].prompt[1:]
    text = " ".join(rt.WORDS[i] for i in ids)
    assert list(tok.encode(text, add_special_tokens=False)) == ids
    assert tok.decode(ids).split() == text.split()


def test_dropping_the_needle_leaves_a_guess(rs: RetrievalSet) -> None:
    drops = needle_drops(rs)
    assert retrieval_accuracy(rs, None, CHUNK, drops=drops) <= 0.15  # chance is 1/32
    # as many blocks elsewhere (never a needle's, never the query's): the answer survives
    rng = random.Random(0)
    bs = rs.engine.kv.block_size
    last = rs.context // bs  # the block holding the query mark and the key
    others = []
    for ex, d in zip(rs.examples, drops):
        free = sorted(set(range(1, last)) - set(rt.needle_blocks(ex, bs, "all")))
        others.append(rng.sample(free, len(d)))
    assert retrieval_accuracy(rs, None, CHUNK, drops=others) >= 0.85
    assert rs.engine.kv.usage().used == 0


def test_a_policy_runs_on_the_retrieval_engine(rs: RetrievalSet) -> None:
    """sinks keeps the last quarter: needles before it are gone (accuracy drops well below full)."""
    press = PressSpec("sinks", sink_tokens=4, window_tokens=rs.context // 4)
    acc = retrieval_accuracy(rs, press, CHUNK)
    assert acc < 0.6
    assert rs.engine.kv.usage().used == 0
