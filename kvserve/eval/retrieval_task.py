"""The synthetic long-context retrieval task behind ``kvserve-tiny-retrieval`` (issue 15, item 4).

A prompt is a haystack of filler words with ``needles`` key/value pairs spread through it, then
one query; the answer is the queried key's value::

    <|endoftext|> f3 f17 k12 v5 f0 ... f9 k40 v22 f21 ... f6 ? k40      ->  v22

(Answering is an induction step: find the earlier occurrence of the current token, copy the
token that followed it.)

Keys are distinct within a prompt, so the answer is decided by exactly one earlier pair: a
policy that drops that pair's KV makes the answer a guess (chance is ``1 / VALUES``), which is
what makes retrieval accuracy a sharp "did eviction lose what mattered". Perplexity on chat text
cannot say this (distant tokens barely matter there).

Invariants: the vocabulary is fixed (ids below); words never overlap between roles (keys,
values, filler); generation uses ``random.Random(seed)`` only, so the same seed gives the same
examples on every platform and torch version.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QUERY = "?"
KEYS, VALUES, FILLERS = 48, 32, 32
WORDS: tuple[str, ...] = (SPECIALS + (QUERY,) + tuple(f"k{i}" for i in range(KEYS))
                          + tuple(f"v{i}" for i in range(VALUES)) + tuple(f"f{i}" for i in range(FILLERS)))
BOS_ID, QUERY_ID = 0, 3
KEY0 = 4
VALUE0 = KEY0 + KEYS
FILLER0 = VALUE0 + VALUES
VOCAB_SIZE = 128  # WORDS padded (ids past len(WORDS) never occur)
CHANCE = 1.0 / VALUES


@dataclass(frozen=True)
class Example:
    """One prompt and its answer. ``needles[i] = (position, key id, value id)``: the needle is
    ``prompt[position] = key``, ``prompt[position + 1] = value``; ``asked`` indexes the queried
    needle (its value is ``answer``)."""

    prompt: list[int]
    answer: int
    needles: list[tuple[int, int, int]]
    asked: int

    @property
    def needle_position(self) -> int:
        """Position of the queried needle's key (its value sits at the next position)."""
        return self.needles[self.asked][0]


def place_needles(rng: random.Random, hay: int, needles: int, start: int) -> list[tuple[int, int, int]]:
    """``needles`` (position, key, value) pairs at non-overlapping even offsets of a haystack of
    ``hay`` tokens beginning at ``start``, keys distinct, sorted by position."""
    if needles > min(KEYS, hay // 2):
        raise ValueError(f"{needles} needles do not fit a haystack of {hay} tokens with {KEYS} keys")
    slots = sorted(rng.sample(range(hay // 2), needles))
    keys = rng.sample(range(KEYS), needles)
    return [(start + 2 * s, KEY0 + k, VALUE0 + rng.randrange(VALUES)) for s, k in zip(slots, keys)]


def haystack(rng: random.Random, hay: int, needles: int) -> tuple[list[int], list[tuple[int, int, int]]]:
    """``[BOS] + hay`` tokens of filler holding the needles (positions count the BOS)."""
    tokens = [BOS_ID] + [FILLER0 + rng.randrange(FILLERS) for _ in range(hay)]
    placed = place_needles(rng, hay, needles, 1)
    for pos, key, value in placed:
        tokens[pos], tokens[pos + 1] = key, value
    return tokens, placed


def make_example(rng: random.Random, length: int, needles: int) -> Example:
    """A prompt of exactly ``length`` tokens (BOS, haystack, ``?``, key) and its answer."""
    tokens, placed = haystack(rng, length - 3, needles)
    asked = rng.randrange(needles)
    _, key, value = placed[asked]
    return Example(tokens + [QUERY_ID, key], value, placed, asked)


def make_examples(seed: int, n: int, length: int, needles: int) -> list[Example]:
    rng = random.Random(seed)
    return [make_example(rng, length, needles) for _ in range(n)]


def save_jsonl(examples: Iterable[Example], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(asdict(ex), separators=(",", ":")) + "\n" for ex in examples)


def load_jsonl(path: Path, limit: int | None = None) -> list[Example]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            d = json.loads(line)
            out.append(Example(d["prompt"], d["answer"], [tuple(n) for n in d["needles"]], d["asked"]))
    return out


def needle_blocks(ex: Example, block_size: int, which: str = "asked") -> list[int]:
    """Logical blocks holding the queried needle's key and value (``which="all"``: every
    needle's)."""
    chosen = ex.needles if which == "all" else [ex.needles[ex.asked]]
    return sorted({p // block_size for pos, _, _ in chosen for p in (pos, pos + 1)})


def accuracy(predicted: Sequence[int], examples: Sequence[Example]) -> float:
    return sum(int(p == ex.answer) for p, ex in zip(predicted, examples)) / max(1, len(examples))


def write_tokenizer(out_dir: Path, max_length: int) -> None:
    """A word-level tokenizer over :data:`WORDS` (ids as listed; words split on whitespace)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from kvserve.tiny.tokenizer import tokenizer_config

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIALS))
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(max_length), indent=2))
