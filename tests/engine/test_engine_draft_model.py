"""Speculative decoding with a draft model (``speculative="draft"``) through the engine on tiny
random-weight models: the tokens are the same with and without it (batched, more requests than
draft rows, seeded sampling, session turns, a runner process), a draft equal to the model has
every draft accepted, a draft close to it has some accepted and some rejected, and bad drafts
are refused at start-up with a message that says what to fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.engine.conftest import write_tiny_llama

PROMPTS = [list(range(100, 112)) * 2, [7, 8, 9, 10] * 6 + [11], [300 + i % 5 for i in range(25)], [42, 17, 3],
           list(range(1000, 1040)), [5] * 9]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def make(model: Path, **kw) -> LLM:
    return LLM(model, dtype="float32", kv_cache_memory="8MiB", block_size=4, **kw)


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def whole(llm: LLM) -> None:
    llm.engine.kv.check()
    assert llm.engine.kv.usage().used == llm.engine.kv.num_pinned_blocks()


def counts(llm: LLM) -> tuple[int, int, int]:
    st = llm.engine.stats()
    return st.spec_verifies, st.spec_draft_tokens, st.spec_accepted_tokens


@pytest.fixture(scope="module")
def near_draft(tiny_llama, tmp_path_factory) -> Path:
    """The model with noise on every weight: it agrees with the model on most tokens, not all."""
    out = tmp_path_factory.mktemp("near-draft")
    for f in tiny_llama.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    gen = torch.Generator().manual_seed(3)
    weights = {name: t + 0.05 * t.std() * torch.randn(t.shape, generator=gen)
               for name, t in load_file(tiny_llama / "model.safetensors").items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def plain(tiny_llama) -> LLM:
    return make(tiny_llama)


@pytest.fixture(scope="module")
def near(tiny_llama, near_draft) -> LLM:
    return make(tiny_llama, speculative="draft", draft_model=near_draft, num_speculative_tokens=4)


def test_the_model_as_its_own_draft_has_every_draft_accepted(plain, tiny_llama):
    llm = make(tiny_llama, speculative="draft", draft_model=tiny_llama, num_speculative_tokens=4)
    assert tokens(llm, PROMPTS[:3], GREEDY) == tokens(plain, PROMPTS[:3], GREEDY)
    verifies, proposed, accepted = counts(llm)
    assert verifies > 0 and proposed > verifies  # drafts of more than one token
    assert accepted == proposed
    whole(llm)


def test_a_near_draft_gives_the_same_tokens_batched_with_more_requests_than_rows(plain, near):
    """Six requests of different lengths: drafting starts once at most four run (the draft
    model's rows), rows are taken over as requests finish."""
    params = [SamplingParams(max_tokens=8 + 5 * i, temperature=0, ignore_eos=True) for i in range(len(PROMPTS))]
    before = counts(near)
    assert tokens(near, PROMPTS, params) == tokens(plain, PROMPTS, params)
    verifies, proposed, accepted = (a - b for a, b in zip(counts(near), before))
    assert verifies > 0
    assert 0 < accepted < proposed  # both the accepting and the rejecting paths ran
    whole(near)


def test_seeded_sampling_is_identical(plain, near):
    params = SamplingParams(max_tokens=20, temperature=0.7, top_k=8, seed=11, ignore_eos=True)
    assert tokens(near, PROMPTS[:3], params) == tokens(plain, PROMPTS[:3], params)
    whole(near)


def test_session_turns_are_identical(tiny_llama, near_draft):
    ref = make(tiny_llama)
    drafted = make(tiny_llama, speculative="draft", draft_model=near_draft, num_speculative_tokens=4)
    for turn in (PROMPTS[0], [1, 2, 3], PROMPTS[1], [4]):
        a = ref.generate({"prompt_token_ids": turn}, GREEDY, session_id="s")[0]
        b = drafted.generate({"prompt_token_ids": turn}, GREEDY, session_id="s")[0]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        whole(drafted)
    assert counts(drafted)[2] > 0


def test_the_draft_runs_in_the_runner_process(plain, tiny_llama, near_draft):
    llm = make(tiny_llama, speculative="draft", draft_model=near_draft, num_speculative_tokens=4, runner="process")
    try:
        assert tokens(llm, PROMPTS[:4], GREEDY) == tokens(plain, PROMPTS[:4], GREEDY)
        assert counts(llm)[2] > 0
        whole(llm)
    finally:
        llm.engine.shutdown()


def test_a_draft_with_fewer_positions_drafts_nothing_past_them(plain, tiny_llama, tmp_path):
    """A draft whose max_position_embeddings ends inside the request: past it the runner pads
    (the model rejects the pads), and the tokens are still the model's."""
    short = write_tiny_llama(tmp_path / "short", max_position_embeddings=30)
    llm = make(tiny_llama, speculative="draft", draft_model=short, num_speculative_tokens=4)
    assert tokens(llm, [PROMPTS[2]], GREEDY) == tokens(plain, [PROMPTS[2]], GREEDY)
    whole(llm)


def test_bad_drafts_are_refused_with_what_to_fix(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="needs draft_model"):
        make(tiny_llama, speculative="draft")
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        make(tiny_llama, speculative="draft", draft_model=tmp_path / "missing")
    other = write_tiny_llama(tmp_path / "other", seed=1)
    vocab = json.loads((other / "tokenizer.json").read_text())
    model_vocab = vocab["model"]["vocab"]
    a, b = list(model_vocab)[10:12]
    model_vocab[a], model_vocab[b] = model_vocab[b], model_vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match="different tokenizer"):
        make(tiny_llama, speculative="draft", draft_model=other)
    with pytest.raises(ValueError, match="draft_model is for speculative method 'draft'"):
        make(tiny_llama, speculative="ngram", draft_model=other)
