"""Retrieval accuracy through the engine: does a KV policy keep what the answer needs?

The shipped ``kvserve-tiny-retrieval`` model (trained by :mod:`kvserve.eval.train_retrieval`)
answers the held-out prompts of :mod:`kvserve.eval.retrieval_task` (``heldout.jsonl`` in its
folder). A policy compresses the prompt up to its query mark ``?`` (the context); the queried key
arrives after that, and the answer is the argmax of the logits at the key's position, computed by
the engine's paged path exactly as the curve scores the chat model (teacher-forced, ``chunk``
tokens per step, the policy applied after every step). So the answer is always computed after
every drop: kvpress's question-agnostic setting. (With the key inside the compressed prompt, the
answer would come from the prefill's own logits, computed before SnapKV drops anything, as a
request's first generated token always is.)

``drops`` forces an eviction: per example, logical blocks given back as soon as they are full
(the KV of those tokens is never read after that step), the oracle that says what losing the
needle costs (near chance) without depending on any policy's choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvserve.engine.engine import LLMEngine
from kvserve.eval import retrieval_task as rt
from kvserve.kv.press import PressSpec

MODEL_NAME = "kvserve-tiny-retrieval"
HELDOUT = "heldout.jsonl"


def shipped_retrieval_model() -> Path | None:
    """The shipped retrieval model's folder, or None when it is not installed."""
    from kvserve.assets import shipped_models

    return shipped_models().get(MODEL_NAME)


def load_heldout(model_dir: str | Path, limit: int | None = None) -> list[rt.Example]:
    path = Path(model_dir) / HELDOUT
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a retrieval model ships its held-out set as {HELDOUT}")
    return rt.load_jsonl(path, limit)


@dataclass(frozen=True)
class RetrievalSet:
    """A retrieval engine (its own KV codec) and the held-out examples it answers; all prompts
    have one length, the context every policy compresses."""

    engine: LLMEngine
    examples: tuple[rt.Example, ...]

    @property
    def context(self) -> int:
        """Tokens a policy compresses: each prompt but its last token (the queried key)."""
        return len(self.examples[0].prompt) - 1

    def __post_init__(self) -> None:
        if not self.examples or len({len(e.prompt) for e in self.examples}) != 1:
            raise ValueError("a retrieval set needs examples, all with prompts of one length")


def answers(rs: RetrievalSet, press: PressSpec | None, chunk: int,
            drops: Sequence[Sequence[int]] | None = None) -> tuple[list[int], int]:
    """The engine's answer to every example under ``press`` (or forced ``drops``), and the
    blocks still held at the end (summed)."""
    from kvserve.eval.evict_curve import score

    seqs = [ex.prompt + [ex.answer] for ex in rs.examples]
    got = score(rs.engine, seqs, rs.context, chunk, press, drops=drops)
    return [int(lp[1].argmax()) for lp in got.logprobs], got.held_blocks  # row 0 predicts the key


def retrieval_accuracy(rs: RetrievalSet, press: PressSpec | None, chunk: int,
                       drops: Sequence[Sequence[int]] | None = None) -> float:
    predicted, _ = answers(rs, press, chunk, drops)
    return rt.accuracy(predicted, rs.examples)


def needle_drops(rs: RetrievalSet, which: str = "asked") -> list[list[int]]:
    """Per example, the blocks holding its queried needle (``"all"``: every needle)."""
    bs = rs.engine.kv.block_size
    return [rt.needle_blocks(ex, bs, which) for ex in rs.examples]
