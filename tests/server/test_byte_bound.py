"""The byte-length bound on tokens (kvserve/server/tokenizing.py): only where it is provable."""

from __future__ import annotations

import copy

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvserve.server.tokenizing import max_token_bytes, min_tokens_of


@pytest.fixture(scope="module")
def shipped(tiny_model):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(tiny_model)


def test_the_bound_holds_on_the_shipped_byte_level_tokenizer(shipped) -> None:  # type: ignore[no-untyped-def]
    bound = max_token_bytes(shipped)
    assert bound is not None and bound >= len("<|im_start|>")
    for text in ("hello world " * 50, "ünïcödé ✓ 漢字 " * 20, "<|im_start|>user\nhi<|im_end|>" * 5, "a" * 999):
        n = len(shipped.encode(text, add_special_tokens=False))
        assert min_tokens_of(text, bound) <= n <= len(text.encode())


def test_no_bound_with_a_normalizer_or_without_byte_level() -> None:
    wordpiece = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    assert max_token_bytes(PreTrainedTokenizerFast(tokenizer_object=wordpiece)) is None
    nfkc = Tokenizer(models.BPE())
    nfkc.normalizer = normalizers.NFKC()
    nfkc.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert max_token_bytes(PreTrainedTokenizerFast(tokenizer_object=nfkc)) is None
    assert min_tokens_of("anything", None) == 0


def test_a_tokenizer_copy_encodes_the_same(shipped) -> None:  # type: ignore[no-untyped-def]
    assert copy.deepcopy(shipped).encode("same text") == shipped.encode("same text")
