"""The tiny model's tokenizer: byte-level round trips, chat specials, ChatML template."""

from __future__ import annotations

import pytest

from kvserve.assets import DEFAULT_MODEL, MODELS_DIR
from kvserve.tiny import data
from kvserve.tiny import tokenizer as tk

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Box:\n    def get(self):\n        return self.value\n",
    "<|im_start|>user\nWrite it.<|im_end|>\n<|im_start|>assistant\nimport os<|im_end|>\n",
] * 20


@pytest.fixture(scope="module")
def shipped():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODELS_DIR / DEFAULT_MODEL, local_files_only=True)


@pytest.mark.parametrize("text", [
    "def f(x):\n\treturn x  # ünïcödé ✓ 漢字\n",
    "    if self._lock is None:\n        raise RuntimeError('no lock')\r\n",
    "",
    "\x00\x01 bytes \udcff".encode("utf-8", "surrogateescape").decode("utf-8", "replace"),
])
def test_shipped_tokenizer_round_trips(shipped, text: str) -> None:
    ids = shipped.encode(text, add_special_tokens=False)
    assert shipped.decode(ids) == text


def test_special_tokens_are_single_ids(shipped) -> None:
    for i, t in enumerate(tk.SPECIAL_TOKENS):
        assert shipped.encode(t, add_special_tokens=False) == [i]
    assert shipped.eos_token == tk.IM_END
    assert shipped.bos_token is None
    assert 1000 < len(shipped) <= 8192


def test_chat_template_matches_training_format(shipped) -> None:
    msgs = [data.Message("user", "Add two numbers."), data.Message("assistant", "def add(a, b):\n    return a + b"),
            data.Message("user", "And subtract?")]
    as_dicts = [{"role": m.role, "content": m.content} for m in msgs]
    text = shipped.apply_chat_template(as_dicts, tokenize=False)
    assert text == data.render_chatml(data.Conversation("x", tuple(msgs)))
    prompt = shipped.apply_chat_template(as_dicts, tokenize=False, add_generation_prompt=True)
    assert prompt == text + "<|im_start|>assistant\n"


def test_encoding_adds_no_bos(shipped) -> None:
    assert shipped.encode("x = 1") == shipped.encode("x = 1", add_special_tokens=False)


def test_training_is_deterministic_and_keeps_special_ids() -> None:
    a = tk.train_tokenizer(CORPUS, vocab_size=300)
    b = tk.train_tokenizer(CORPUS, vocab_size=300)
    assert a.get_vocab() == b.get_vocab()
    assert [a.token_to_id(t) for t in tk.SPECIAL_TOKENS] == [0, 1, 2]
    assert a.encode("<|im_start|>user\n").ids[0] == 1


def test_too_small_vocab_is_rejected() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        tk.train_tokenizer(CORPUS, vocab_size=100)


def test_saved_tokenizer_loads_with_transformers(tmp_path) -> None:
    from transformers import AutoTokenizer

    tk.save_tokenizer(tk.train_tokenizer(CORPUS, vocab_size=300), tmp_path, max_length=128)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "def add(a, b):\n    return a + b\n"
    assert loaded.decode(loaded.encode(text)) == text
    assert loaded.model_max_length == 128
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )
