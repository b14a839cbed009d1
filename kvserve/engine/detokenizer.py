"""Incremental detokenization and stop strings.

Decoding only the tail keeps the per-token cost constant: the text of ``ids[prefix:]`` minus the
text of ``ids[prefix:read]`` is the new text, held back while it ends in an incomplete UTF-8
sequence (U+FFFD). A stop string ends the request and is cut from the text (unless
``include_stop_str_in_output``); the text never runs past it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.sampling_params import SamplingParams


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    params: SamplingParams
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    stopped_by: str | None = None
    _ids: list[int] = field(default_factory=list)

    def add(self, token_ids: list[int]) -> str:
        """Feed the request's newly generated ids; returns the new text (after stop handling)."""
        before = len(self.text)
        for tid in token_ids:
            self._ids.append(tid)
            self.text += self._next_piece()
            if self._apply_stop(before):
                break
        return self.text[before:]

    @property
    def num_consumed(self) -> int:
        """Token ids fed so far (a stop string ends the feeding at the token that completed it)."""
        return len(self._ids)

    def _next_piece(self) -> str:
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self._ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(self._ids[self.prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
            return full[len(prefix):]
        return ""

    def _apply_stop(self, before: int) -> bool:
        if not self.params.stop:
            return False
        longest = max(len(s) for s in self.params.stop)
        search_from = max(0, before - longest + 1)
        for stop in self.params.stop:
            idx = self.text.find(stop, search_from)
            if idx >= 0:
                end = idx + len(stop) if self.params.include_stop_str_in_output else idx
                self.text = self.text[:end]
                self.stopped_by = stop
                return True
        return False
