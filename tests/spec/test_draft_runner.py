"""The draft model's KV rows (:mod:`kvserve.runner.draft_runner`) as a state machine: whatever
sequence of fills, verifies (some drafts kept, a new token after them), forgotten requests and
row takeovers, a fill proposes exactly what ``transformers`` greedily generates with the draft
checkpoint from the same tokens (the reference, no cache of ours). So a row's KV is always the
KV of the tokens it says it holds, and the drafts are the draft model's greedy continuation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.contract import ScheduledChunk
from kvserve.model.attention_choice import select_backend
from kvserve.model.loader import load_model
from kvserve.runner.draft_runner import DraftRunner
from kvserve.runner.state import RequestState
from kvserve.sampling_params import SamplingParams
from kvserve.spec.drafter import DRAFT_PLACEHOLDER
from tests.engine.conftest import write_tiny_llama

BLOCK = 4
MAX_LEN = 96
IDS = ("a", "b", "c")


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("draft"), seed=5, num_hidden_layers=1, max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def draft_model(draft_path):
    return load_model(draft_path, dtype="float32")


@pytest.fixture(scope="module")
def hf_draft(draft_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.float32).eval()


def runner(draft_model, rows: int) -> DraftRunner:
    model, config = draft_model
    attention = select_backend("native", heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                               head_dim=config.head_dim, block_size=BLOCK, dtype=torch.float32)
    return DraftRunner(model, config, rows=rows, max_len=MAX_LEN, block_size=BLOCK, target_vocab=config.vocab_size,
                       attention=attention, device=torch.device("cpu"))


def fill(r: DraftRunner, states: dict[str, RequestState], jobs: dict[str, int]) -> dict[str, list[int]]:
    """Ask for ``jobs[rid]`` drafts after each request's real tokens; the drafts each got."""
    chunks = []
    for rid, k in jobs.items():
        s = states[rid]
        last = len(s.token_ids)
        s.token_ids.extend([DRAFT_PLACEHOLDER] * k)
        chunks.append(ScheduledChunk(rid, last - 1, 1 + k, [], list(range(64)), num_sample=1 + k, model_drafts=k))
    r.fill(chunks, states)
    return {rid: states[rid].token_ids[-k:] for rid, k in jobs.items()}


@torch.inference_mode()
def reference_drafts(hf, tokens: list[int], k: int) -> list[int]:
    """The draft checkpoint's greedy continuation in transformers."""
    out = hf.generate(torch.tensor([tokens]), max_new_tokens=k, min_new_tokens=k, do_sample=False,
                      attention_mask=torch.ones(1, len(tokens), dtype=torch.long), pad_token_id=0)
    return out[0, len(tokens):].tolist()


def _state(rid: str, tokens: list[int]) -> RequestState:
    return RequestState(rid, 1, SamplingParams(max_tokens=MAX_LEN), 0, None, (), token_ids=list(tokens))


op = st.one_of(
    st.tuples(st.just("step"), st.dictionaries(st.sampled_from(IDS), st.integers(1, 4), min_size=1, max_size=2),
              st.lists(st.integers(0, 4), min_size=2, max_size=2), st.integers(0, 4095)),
    st.tuples(st.just("forget"), st.sampled_from(IDS)),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=1, max_size=12), prompts=st.lists(
    st.lists(st.integers(0, 4095), min_size=1, max_size=20), min_size=3, max_size=3))
def test_fills_propose_the_reference_greedy_continuation(draft_model, hf_draft, ops, prompts):
    r = runner(draft_model, rows=2)
    states: dict[str, RequestState] = {}
    for o in ops:
        if o[0] == "forget":
            states.pop(o[1], None)
            continue
        _, jobs, kept, bonus = o
        for i, rid in enumerate(IDS):
            states.setdefault(rid, _state(rid, prompts[i]))
        jobs = {rid: k for rid, k in jobs.items() if len(states[rid].token_ids) + k < MAX_LEN - 4}
        if not jobs:
            continue
        real = {rid: list(states[rid].token_ids) for rid in jobs}
        got = fill(r, states, jobs)
        for j, (rid, k) in enumerate(jobs.items()):
            assert got[rid] == reference_drafts(hf_draft, real[rid], k), rid
            # the verify keeps the first few drafts, then a token of its own; the rest leave
            keep = min(kept[j % 2], k)
            states[rid].token_ids[len(real[rid]) + keep:] = [bonus]


def test_every_row_held_by_a_drafting_request_is_an_error(draft_model):
    r = runner(draft_model, rows=1)
    states = {rid: _state(rid, [1, 2, 3]) for rid in ("a", "b")}
    with pytest.raises(RuntimeError, match="rows"):
        fill(r, states, {"a": 2, "b": 2})


def test_a_request_past_the_draft_length_gets_its_last_token_repeated(draft_model):
    r = runner(draft_model, rows=1)
    tokens = list(range(10, 10 + MAX_LEN - 1))  # the last real token sits at position MAX_LEN - 2
    got = fill(r, {"a": _state("a", tokens)}, {"a": 4})["a"]
    assert got[2:] == [tokens[-1], tokens[-1]]  # positions MAX_LEN and MAX_LEN + 1 are past its rope
    assert r.forwards == 2


def test_a_long_catch_up_is_fed_in_slices_and_drafts_the_same(draft_model, hf_draft, monkeypatch):
    from kvserve.runner import draft_runner

    monkeypatch.setattr(draft_runner, "CATCH_UP", 3)
    r = runner(draft_model, rows=2)
    long, short = list(range(200, 217)), [5, 6]
    states = {"a": _state("a", long), "b": _state("b", short)}
    got = fill(r, states, {"a": 2, "b": 2})
    assert got["a"] == reference_drafts(hf_draft, long, 2)
    assert got["b"] == reference_drafts(hf_draft, short, 2)
    # 17 tokens: 5 slices of 3 before the first draft forward feeds the last 2; then one more
    assert r.forwards == 5 + 2
