"""The new sampling fields through the real server, each against a greedy reference computed
here: the tiny model's logits (transformers, same weights) with the processor applied by hand."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from kvserve.runner.logits_processors import apply_logits_processors
from kvserve.sampling_params import SamplingParams
from tests.server.conftest import MODEL_NAME, LiveServer

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def hf(tiny_model):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def reference(model: Any, params: SamplingParams, steps: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([PROMPT + out])).logits[0, -1].float()
            out.append(int(torch.argmax(apply_logits_processors(logits, params, PROMPT, out, (2,)))))
    return out


def served(live: LiveServer, **fields: Any) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **fields}
    return httpx.post(live.v1 + "/completions", json=body, timeout=60)


@pytest.mark.parametrize("fields", [
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"frequency_penalty": -1.0, "presence_penalty": 0.5},
    {"logit_bias": {"7": 8.0, "100": -100.0}},
])
def test_penalties_and_bias_match_the_hand_applied_reference(live: LiveServer, hf: Any, fields: dict) -> None:  # type: ignore[type-arg]
    r = served(live, **fields)
    if r.status_code == 400 and "not applied" in r.text:
        pytest.skip(f"the engine's sampler does not apply {fields} yet")
    assert r.status_code == 200, r.text
    bias = {int(k): v for k, v in fields.get("logit_bias", {}).items()} or None
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias,
                            **{k: v for k, v in fields.items() if k != "logit_bias"})
    plain = served(live).json()["choices"][0]["token_ids"]
    want = reference(hf, params, 8)
    got = r.json()["choices"][0]["token_ids"]
    assert got == want
    assert reference(hf, SamplingParams(temperature=0, max_tokens=8), 8) == plain  # the reference is sound


def test_bad_words_are_never_generated(live: LiveServer, hf: Any) -> None:
    plain = served(live).json()["choices"][0]["token_ids"]
    tok = live.engine.engine.tokenizer
    word = tok.decode([plain[0]])
    r = served(live, bad_words=[word])
    if r.status_code == 400 and "not applied" in r.text:
        pytest.skip("bad_words not applied yet")
    assert r.status_code == 200, r.text
    assert plain[0] not in r.json()["choices"][0]["token_ids"]


def test_min_tokens_holds_back_eos(live: LiveServer, hf: Any) -> None:
    # make EOS (id 2) the greedy choice with a bias, then require 3 tokens first
    r = served(live, ignore_eos=False, logit_bias={"2": 100.0}, min_tokens=3)
    if r.status_code == 400 and "not applied" in r.text:
        pytest.skip("min_tokens not applied yet")
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) in (3, 4) and 2 not in choice["token_ids"][:3]
    assert choice["finish_reason"] == "stop"
    assert served(live, ignore_eos=False, logit_bias={"2": 100.0}).json()["choices"][0]["finish_reason"] == "stop"
