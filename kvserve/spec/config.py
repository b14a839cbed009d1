"""Speculative decoding's settings (part of :class:`kvserve.config.SchedulerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (kvserve/spec, docs/speed.md). ``method=None``: off.

    ``"ngram"`` drafts up to ``num_speculative_tokens`` tokens by finding the request's last
    ``ngram_max`` .. ``ngram_min`` tokens earlier in its own tokens (prompt, session history and
    output) and copying what followed; ``"draft"`` has a small model (``draft_model``: an HF
    checkpoint whose tokenizer is the target's) propose them greedily in the runner, from its own
    KV rows (:mod:`kvserve.runner.draft_runner`). One forward of the target verifies them. Drafts
    are made only while at most ``max_num_seqs`` requests run (above it, verification costs more
    than it saves)."""

    method: str | None = None
    num_speculative_tokens: int = 8
    ngram_min: int = 2
    ngram_max: int = 4
    max_num_seqs: int = 4
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)} or None, "
                             f"got {self.method!r}")
        if self.num_speculative_tokens <= 0:
            raise ValueError(f"num_speculative_tokens must be > 0, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= ngram_min <= ngram_max, "
                             f"got {self.ngram_min}..{self.ngram_max}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"speculative max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model (a checkpoint directory)")
        if self.draft_model and self.method != "draft":
            raise ValueError(f"draft_model is for speculative method 'draft', got method {self.method!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def by_model(self) -> bool:
        """Drafts come from a draft model in the runner (placeholders until it fills them)."""
        return self.method == "draft"
