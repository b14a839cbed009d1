"""The stdlib chat data set: deterministic, shaped as chat, held out by whole file."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from kvserve.tiny import data

SOURCE = '''"""A small module."""

import os

LIMIT = 3


# Add two numbers.
def add(a, b):
    return a + b


class Box:
    """Holds one value."""

    def get(self):
        return self.value


def undocumented(x):
    return x
'''


@pytest.fixture(scope="module")
def dataset() -> data.ChatDataset:
    return data.build_dataset()


def test_module_turns_pair_descriptions_with_code() -> None:
    pairs = data.module_turns("pkg/small.py", SOURCE)
    assert len(pairs) == 4  # header, add, Box, undocumented
    header_ask, header_code = pairs[0]
    assert "`pkg.small`" in header_ask and "A small module." in header_ask
    assert "import os" in header_code and "def add" not in header_code
    assert "Add two numbers." in pairs[1][0] and pairs[1][1].startswith("def add(a, b):")
    assert "Holds one value." in pairs[2][0] and pairs[2][1].startswith("class Box:")
    assert pairs[3][0] == "Write the function `undocumented` in `pkg.small`."
    assert pairs[3][1] == "def undocumented(x):\n    return x"


def test_unparsable_source_gives_no_turns() -> None:
    assert data.module_turns("bad.py", "def (:\n") == []


def test_render_chatml_is_chatml() -> None:
    conv = data.Conversation("x.py", (data.Message("user", "hi"), data.Message("assistant", "def f(): pass")))
    assert data.render_chatml(conv) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\ndef f(): pass<|im_end|>\n"
    )


def test_bad_role_is_rejected() -> None:
    with pytest.raises(ValueError, match="role"):
        data.Message("robot", "x")


def test_heldout_is_whole_files_disjoint_from_training(dataset: data.ChatDataset) -> None:
    train_sources = {c.source for c in dataset.train}
    held_sources = {c.source for c in dataset.heldout}
    assert train_sources and held_sources
    assert not train_sources & held_sources
    assert all(data.is_heldout(s) for s in held_sources)
    assert not any(data.is_heldout(s) for s in train_sources)
    share = len(held_sources) / (len(held_sources) + len(train_sources))
    assert 0.02 < share < 0.10


def test_conversations_alternate_user_assistant(dataset: data.ChatDataset) -> None:
    for conv in dataset.train[::50] + dataset.heldout:
        roles = [m.role for m in conv.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert all(m.content for m in conv.messages)
    multi_turn = [c for c in dataset.train if len(c.messages) >= 6]
    assert len(multi_turn) > 100


def test_builder_is_deterministic(dataset: data.ChatDataset) -> None:
    """The fast held-out rebuild equals the full build's held-out part, text for text."""
    texts = data.heldout_texts()
    assert texts == [data.render_chatml(c) for c in dataset.heldout]
    # another process with another str-hash salt builds the same split (a salted ``hash`` or set
    # order in the split would differ here, where calling twice in one process could not)
    code = ("import hashlib, sys; from kvserve.tiny import data; "
            "sys.stdout.write(hashlib.sha256('\\0'.join(data.heldout_texts()).encode()).hexdigest())")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                           timeout=240).stdout
    assert other == hashlib.sha256("\0".join(texts).encode()).hexdigest()


def test_file_list_is_sorted_and_skips_tests() -> None:
    files = data.source_files()
    assert files == sorted(files)
    assert len(files) > 500
    assert not any("/test/" in f or f.startswith("test/") or "site-packages" in f for f in files)
    assert "os.py" in files


def test_is_heldout_does_not_depend_on_python_hash_seed() -> None:
    import subprocess
    import sys

    code = "from kvserve.tiny.data import is_heldout as h; print([h(f'm{i}.py') for i in range(200)])"
    runs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PYTHONPATH": ":".join(sys.path)}).stdout
        for seed in ("1", "2")
    }
    assert len(runs) == 1
    assert str([data.is_heldout(f"m{i}.py") for i in range(200)]) == runs.pop().strip()
