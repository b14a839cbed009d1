"""The tokens a new chat turn adds to a session, without re-tokenizing the history.

The engine's session already holds the history as token ids. For a new turn we need only the
templated tokens of the new messages plus the generation prompt. We render the chat template
over the whole conversation as text and keep the part after what the model has already seen
(``seen``: every earlier turn's templated text plus the replies exactly as generated, special
tokens included), then tokenize only that tail::

    full  = template(messages + new, add_generation_prompt=True)
    seen  = "…<|im_start|>assistant\\nreply<|im_end|>"
    delta = full[len(seen):]       "\\n<|im_start|>user\\nnew<|im_end|>\\n<|im_start|>assistant\\n"

If the template rewrites earlier text (some strip or reformat old turns), ``full`` no longer
starts with ``seen``; then the new messages are templated alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Message = dict[str, str]


@dataclass
class ChatTranscript:
    tokenizer: Any
    messages: list[Message] = field(default_factory=list)
    seen: str = ""
    _before_turn: tuple[int, int] = (0, 0)

    def next_turn_ids(self, new_messages: list[Message]) -> list[int]:
        """Token ids of ``new_messages`` (templated, with the generation prompt) to append."""
        if not new_messages:
            raise ValueError("messages is empty; give at least one new message for the turn")
        full = self._render(self.messages + new_messages)
        if self.seen and full.startswith(self.seen):
            delta = full[len(self.seen):]
        else:
            delta = self._render(new_messages) if self.seen else full
        self._before_turn = (len(self.messages), len(self.seen))
        self.messages.extend(new_messages)
        self.seen += delta
        return list(self.tokenizer.encode(delta, add_special_tokens=False))

    def record_reply(self, token_ids: list[int]) -> str:
        """Remember the reply as generated; returns its text (special tokens skipped)."""
        self.seen += self.tokenizer.decode(token_ids, skip_special_tokens=False)
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def abandon_turn(self) -> None:
        """Forget the turn begun by the last ``next_turn_ids`` (it was aborted or rejected)."""
        n_msgs, n_seen = self._before_turn
        del self.messages[n_msgs:]
        self.seen = self.seen[:n_seen]

    def _render(self, messages: list[Message]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
