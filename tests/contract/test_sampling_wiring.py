"""The sampler applies the request's logits processors and grammar, through the engine, against
hand-computed expectations on the embedded chat model (greedy unless stated)."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.contract import ScheduledChunk, SchedulerOutput

PROMPT = {"prompt_token_ids": [1, 300, 301, 302, 303, 300, 301]}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="16MiB", num_threads=1)


def out_ids(llm: LLM, **kw) -> list[int]:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0.0, ignore_eos=True, **{"max_tokens": 6, **kw})
    return llm.generate(PROMPT, params)[0].outputs[0].token_ids


def last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Raw logits at the last position (teacher-forced through the engine's own runner)."""
    eng = llm.engine
    from kvserve.request import Request, RequestStatus

    req = Request("probe", ids, SamplingParams(max_tokens=1))
    assert eng.kv.allocate_slots(req, len(ids))
    try:
        logits = eng.runner.score(SchedulerOutput(chunks=[ScheduledChunk("probe", 0, len(ids), ids,
                                                                          eng.kv.block_table("probe"))]))
    finally:
        req.status = RequestStatus.FINISHED_ABORTED
        eng.kv.free(req)
        eng.runner.execute(SchedulerOutput(finished=["probe"]))
    return logits[-1]


def test_logit_bias_and_allowed_token_ids(llm: LLM) -> None:
    assert out_ids(llm, logit_bias={777: 100.0}) == [777] * 6
    allowed = (5, 9, 400)
    assert set(out_ids(llm, allowed_token_ids=allowed)) <= set(allowed)


def test_min_tokens_masks_stop_tokens_until_reached(llm: LLM) -> None:
    first = out_ids(llm)[0]
    stopped = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(first,)))[0]
    assert stopped.outputs[0].token_ids == [first]
    held = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(first,),
                                               min_tokens=3))[0].outputs[0].token_ids
    assert len(held) >= 3 and first not in held[:3]


def test_repetition_penalty_matches_the_hand_computation(llm: LLM) -> None:
    ids = PROMPT["prompt_token_ids"]
    raw = last_logits(llm, ids)
    penalty = 3.0
    ref = raw.clone()
    for t in set(ids):  # vLLM's rule: positive logits divided, negative multiplied
        ref[t] = ref[t] / penalty if ref[t] > 0 else ref[t] * penalty
    assert out_ids(llm, repetition_penalty=penalty, max_tokens=1) == [int(torch.argmax(ref))]


def test_presence_and_frequency_penalties_match_the_hand_computation(llm: LLM) -> None:
    ids = PROMPT["prompt_token_ids"]
    g0 = out_ids(llm, max_tokens=1)[0]
    for freq, pres in ((0.0, 2.0), (1.5, 0.0), (1.0, 1.0)):
        got = out_ids(llm, frequency_penalty=freq, presence_penalty=pres, max_tokens=3)
        assert got[0] == g0  # nothing generated yet: nothing penalised
        # step 2 by hand: the output so far is [g0], so g0's logit drops by freq * 1 + pres
        ref = last_logits(llm, ids + [g0]).clone()
        ref[g0] -= freq * 1 + pres
        assert got[1] == int(torch.argmax(ref))
        # step 3 by hand: counts over [g0, got[1]]
        ref = last_logits(llm, ids + got[:2]).clone()
        for t in set(got[:2]):
            ref[t] -= freq * got[:2].count(t) + pres
        assert got[2] == int(torch.argmax(ref))


def test_json_schema_output_parses(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert json.loads(out.text)["answer"] in ("yes", "no")
    assert out.finish_reason == "stop"


def test_a_seeded_sample_with_min_p_is_reproducible_and_inside_the_filter(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, min_p=0.2, seed=7, max_tokens=1)
    a = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    assert a == llm.generate(PROMPT, params)[0].outputs[0].token_ids
    probs = torch.softmax(last_logits(llm, PROMPT["prompt_token_ids"]), -1)
    assert probs[a[0]] >= 0.2 * probs.max()
