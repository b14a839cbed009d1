"""Incremental detokenization: the fast decode (the Rust tokenizer's own) is used only where it is
transformers' ``decode`` exactly, and the incremental text equals decoding the whole output."""

from __future__ import annotations

import random

import pytest

from kvserve.engine.detokenizer import IncrementalDetokenizer, decoder_of
from kvserve.model.loader import load_tokenizer
from kvserve.sampling_params import SamplingParams
from tests.engine.conftest import TOKENIZER_DIR


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER_DIR)


@pytest.mark.parametrize("skip", [True, False])
def test_fast_decode_equals_transformers_decode(tokenizer, skip: bool) -> None:
    fast = decoder_of(tokenizer)
    assert fast is not tokenizer.decode  # the shipped tokenizer takes the fast path
    rng = random.Random(0)
    specials = list(tokenizer.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 12))] + rng.sample(specials, 1)
        rng.shuffle(ids)
        assert fast(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert decoder_of(tokenizer) == tokenizer.decode


def test_incremental_text_equals_the_whole_decode(tokenizer) -> None:
    ids = tokenizer.encode("Paged KV: ünïcödé, emoji 🙂 and\nnew lines — all of it, token by token.")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip))
        pieces = [detok.add([t]) for t in ids]
        assert "".join(pieces) == detok.text == tokenizer.decode(ids, skip_special_tokens=skip)
