"""Chat transcripts of sessions, so a chat turn sends the engine only its new tokens.

The engine's session keeps the conversation as token ids and its KV pinned; a new turn appends
tokens. Over HTTP a client may send either only the new messages or, as most OpenAI clients do,
the whole conversation again. The rule:

  * if the request's messages start with everything this session has seen (our replies exactly as
    we returned them), only the messages after that are new;
  * otherwise all of the request's messages are new (the client sends one turn at a time).

The new messages are templated with :class:`ChatTranscript` (the template over the whole
conversation, minus what the model has already seen) and never re-tokenize the history.

A transcript is trusted only while the engine's session holds exactly the tokens it expects; if
something else changed the session (a completions call, ``drop_oldest``), the transcript starts
afresh and the new messages are templated alone. One turn at a time per session (409 otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.chat_session import ChatTranscript, Message
from kvserve.request import RequestOutput
from kvserve.server.errors import APIError


@dataclass
class _Record:
    transcript: ChatTranscript
    sent: list[Message] = field(default_factory=list)  # the conversation as the client sees it
    expected_tokens: int = 0
    turn_start: int = 0


class ChatSessions:
    """Per-session transcripts; used from the event loop thread only."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._records: dict[str, _Record] = {}
        self._busy: set[str] = set()

    def begin_turn(self, session_id: str, messages: list[Message], engine_tokens: int | None) -> list[int]:
        """Token ids the turn appends. ``engine_tokens``: the engine session's length (None: new)."""
        self.claim(session_id)
        rec = self._records.get(session_id)
        if rec is None or engine_tokens is None or rec.expected_tokens != engine_tokens:
            rec = _Record(ChatTranscript(self.tokenizer))
            self._records[session_id] = rec
        seen = rec.sent
        new = messages[len(seen):] if len(messages) > len(seen) and messages[:len(seen)] == seen else messages
        try:
            ids = rec.transcript.next_turn_ids(new)  # changes nothing if it raises
        except Exception:
            self.release(session_id)
            raise
        rec.turn_start = len(rec.sent)
        rec.sent.extend(new)
        return ids

    def claim(self, session_id: str) -> None:
        """Mark the session busy (any API); 409 if a turn is already in flight."""
        if session_id in self._busy:
            raise APIError(409, f"session {session_id!r} is already serving a turn; wait for it to finish",
                           param="session_id", code="session_busy")
        self._busy.add(session_id)

    def release(self, session_id: str) -> None:
        self._busy.discard(session_id)

    def finish_turn(self, session_id: str, out: RequestOutput) -> None:
        rec = self._records.get(session_id)
        self.release(session_id)
        if rec is None:
            return
        reply = out.outputs[0]
        rec.transcript.record_reply(reply.token_ids)
        rec.sent.append({"role": "assistant", "content": reply.text})
        rec.expected_tokens = len(out.prompt_token_ids) + len(reply.token_ids)

    def end_turn(self, session_id: str, final: RequestOutput | None) -> None:
        """The engine ended the turn: keep it if it completed, forget it if it was aborted."""
        if final is not None and final.outputs and final.outputs[0].finish_reason in ("stop", "length"):
            self.finish_turn(session_id, final)
        else:
            self.abandon_turn(session_id)

    def abandon_turn(self, session_id: str) -> None:
        rec = self._records.get(session_id)
        self.release(session_id)
        if rec is not None:
            rec.transcript.abandon_turn()
            del rec.sent[rec.turn_start:]

    def forget(self, session_id: str) -> None:
        self._records.pop(session_id, None)
