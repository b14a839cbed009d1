"""The pure logits processors and SamplingParams' new checks, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.runner.logits_processors import (
    apply_logits_processors,
    apply_min_p,
    bad_words_token_ids,
    banned_by_bad_words,
)
from kvserve.sampling_params import SamplingParams

INF = float("-inf")


def row(*vals: float) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float32)


def test_nothing_active_returns_the_same_tensor() -> None:
    x = row(1.0, 2.0)
    assert apply_logits_processors(x, SamplingParams(), [0], [1], (1,)) is x


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output() -> None:
    x = row(2.0, -1.0, 3.0, 4.0)
    out = apply_logits_processors(x, SamplingParams(repetition_penalty=2.0), prompt_ids=[0], output_ids=[1, 1])
    assert out.tolist() == [1.0, -2.0, 3.0, 4.0]
    assert x.tolist() == [2.0, -1.0, 3.0, 4.0]  # input untouched


def test_frequency_and_presence_count_output_tokens_only() -> None:
    x = row(1.0, 1.0, 1.0, 1.0)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_logits_processors(x, p, prompt_ids=[3, 3, 3], output_ids=[0, 0, 2])
    # token 0: 1 - 0.5*2 - 0.25 = -0.25; token 2: 1 - 0.5 - 0.25 = 0.25; prompt-only token 3 untouched
    assert out.tolist() == [-0.25, 1.0, 0.25, 1.0]


def test_logit_bias_is_added_and_out_of_vocab_ids_ignored() -> None:
    out = apply_logits_processors(row(0.0, 1.0, 2.0), SamplingParams(logit_bias={1: -3.5, 2: 10.0, 99: 5.0}), [], [])
    assert out.tolist() == [0.0, -2.5, 12.0]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    p = SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=(3,))
    before = apply_logits_processors(row(1, 2, 3, 4, 5), p, [0], [1], eos_ids=(4,))
    assert before.tolist() == [1, 2, 3, INF, INF]
    after = apply_logits_processors(row(1, 2, 3, 4, 5), p, [0], [1, 1], eos_ids=(4,))
    assert after.tolist() == [1, 2, 3, 4, 5]


def test_allowed_token_ids_mask_everything_else() -> None:
    out = apply_logits_processors(row(1, 2, 3, 4), SamplingParams(allowed_token_ids=(1, 3)), [], [])
    assert out.tolist() == [INF, 2, INF, 4]


def test_bad_words_single_and_multi_token() -> None:
    words = ((2,), (0, 1, 3))
    assert banned_by_bad_words(words, []) == {2}
    assert banned_by_bad_words(words, [5, 0]) == {2}          # only the first token of the word so far
    assert banned_by_bad_words(words, [5, 0, 1]) == {2, 3}    # the next token would complete the word
    p = SamplingParams(bad_words_token_ids=words)
    assert apply_logits_processors(row(1, 1, 1, 1), p, [], [0, 1]).tolist() == [1, 1, INF, INF]


def test_order_bias_then_repetition_penalty() -> None:
    # vLLM v1 order: logit_bias first, then the repetition penalty sees the biased value
    p = SamplingParams(logit_bias={0: 2.0}, repetition_penalty=2.0)
    assert apply_logits_processors(row(-1.0, 1.0), p, [0], []).tolist() == [0.5, 1.0]


def test_min_p_keeps_tokens_within_fraction_of_top_probability() -> None:
    logits = torch.log(row(0.5, 0.3, 0.15, 0.05))
    out = apply_min_p(logits, 0.5)  # threshold 0.25: keeps 0.5 and 0.3
    assert torch.isfinite(out).tolist() == [True, True, False, False]
    assert apply_min_p(logits, 0.0) is logits


def test_bad_words_token_ids_from_tokenizer(tiny_model) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    seqs = bad_words_token_ids(tok, ["hello"])
    assert tuple(tok.encode("hello", add_special_tokens=False)) in seqs
    assert tuple(tok.encode(" hello", add_special_tokens=False)) in seqs


@pytest.mark.parametrize("temperature", [0.0, 1e-40, 9.9e-6])
def test_tiny_temperatures_are_greedy(temperature: float) -> None:
    assert SamplingParams(temperature=temperature).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_seed_must_fit_int64_for_every_sample() -> None:
    SamplingParams(seed=2**63 - 1)
    SamplingParams(seed=-(2**63))
    with pytest.raises(ValueError, match="int64"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match="int64"):
        SamplingParams(seed=2**63 - 1, n=2)
    SamplingParams(seed=2**63 - 1 - 1_000_003, n=2)


@pytest.mark.parametrize("kw", [{"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
                                {"repetition_penalty": math.inf}, {"min_p": 1.5}, {"logit_bias": {1: 101.0}},
                                {"logit_bias": {-1: 1.0}}, {"min_tokens": 17}, {"allowed_token_ids": ()},
                                {"bad_words": ("",)}, {"response_format": {"type": "xml"}},
                                {"response_format": {"type": "json_schema"}}, {"temperature": math.nan}])
def test_bad_values_raise(kw: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_params_stay_hashable_with_dict_fields() -> None:
    p = SamplingParams(logit_bias={1: 1.0}, response_format={"type": "json_object"})
    assert isinstance(hash(p), int) and p.structured
