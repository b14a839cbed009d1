"""Constrained decoding (kvserve/runner/structured.py): a greedy loop over the tiny random model
with the grammar's mask applied produces text that json.loads accepts."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.runner.structured import from_tokenizer, validate_response_format

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def hf(tiny_model):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model)


def greedy_constrained(model, tok, response_format, budget: int = 80) -> tuple[str, bool]:  # type: ignore[no-untyped-def]
    m = from_tokenizer(tok, response_format, vocab_size=model.config.vocab_size, stop_token_ids=[2])
    assert m is not None
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(budget):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            allowed = m.allowed_mask(logits.shape[-1])
            assert allowed.any()
            token = int(torch.argmax(m.apply(logits)))
            assert allowed[token]
            assert m.accept(token)
            if m.is_terminated():
                return tok.decode(out), True
            out.append(token)
    return tok.decode(out), False


@pytest.mark.parametrize("rf", [{"type": "json_object"},
                                {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}])
def test_greedy_loop_with_mask_yields_json(hf, rf) -> None:  # type: ignore[no-untyped-def]
    model, tok = hf
    text, done = greedy_constrained(model, tok, rf)
    assert done, text
    value = json.loads(text)
    assert isinstance(value, dict)
    if rf["type"] == "json_schema":
        assert set(value) == {"name", "n", "ok"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 999


def test_unconstrained_formats_give_no_matcher(hf) -> None:  # type: ignore[no-untyped-def]
    _, tok = hf
    assert from_tokenizer(tok, None) is None
    assert from_tokenizer(tok, {"type": "text"}) is None


def test_a_token_outside_the_grammar_is_refused(hf) -> None:  # type: ignore[no-untyped-def]
    _, tok = hf
    m = from_tokenizer(tok, {"type": "json_object"}, vocab_size=4096)
    assert m is not None
    letter = tok.encode("a", add_special_tokens=False)[0]
    assert not m.allowed_mask()[letter] and not m.accept(letter)
    brace = tok.encode("{", add_special_tokens=False)[0]
    assert m.allowed_mask()[brace] and m.accept(brace)


@pytest.mark.parametrize("rf", [{"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
                                {"type": "json_schema", "json_schema": "x"}, {"type": "yaml"}])
def test_bad_formats_raise_value_error(hf, rf) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        validate_response_format(hf[1], rf)
