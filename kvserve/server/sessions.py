"""Chat transcripts of sessions, so a chat turn sends the engine only its new tokens.

The engine's session manager is the one owner of session state (history, KV, whether a turn is
in flight: it refuses a second turn with "already serving a turn" → 409). This module only keeps,
per session, the conversation as the client sees it, to decide what a chat turn adds:

  * the request's messages start with everything the session has seen (our replies exactly as
    we returned them): only the messages after that are new (**extension**: appended);
  * the request holds only new messages, i.e. no assistant message and not the start of the
    history again (a client that sends one turn at a time): all of them are new (appended);
  * otherwise the client resends a conversation that is not this session's (say a benchmark
    rerun reusing ``CONV_ID_0``): the turn **restarts** the session under that id: the old
    history and KV are released and the request's messages are the whole conversation; the
    response says ``session_restarted: true``.

The new messages are templated with :class:`ChatTranscript` (the template over the whole
conversation, minus what the model has already seen), never re-tokenizing the history. A
transcript is trusted only while the engine's session holds exactly the tokens it expects; if
something else changed the session (a completions call, ``drop_oldest``), the new messages are
templated alone.

Concurrency: a turn is prepared under a per-session lock (read the engine's session, plan, add
the request) so two requests for one session cannot both plan against the same state; the
lock is not held while the turn generates. Plans are pure (a copy of the transcript), made on
a tokenizer worker thread; the record changes only on the event loop, when the engine accepted
the turn (``commit``) and when it ended (``end_turn``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.chat_session import ChatTranscript, Message
from kvserve.request import RequestOutput


@dataclass
class _Record:
    transcript: ChatTranscript
    sent: list[Message] = field(default_factory=list)  # the conversation as the client sees it
    expected_tokens: int = 0
    version: int = 0
    previous: _Record | None = None  # the record before this turn, restored if the turn is aborted

    @classmethod
    def from_meta(cls, meta: dict[str, Any], tokenizer: Any) -> _Record:
        return cls(ChatTranscript(tokenizer, list(meta["messages"]), meta["seen"]), list(meta["sent"]),
                   int(meta["expected_tokens"]))


@dataclass
class TurnPlan:
    """What a chat turn sends: ``ids`` to append (after ``restart``, the whole conversation)."""

    ids: list[int]
    restart: bool
    new_messages: list[Message]
    transcript: ChatTranscript
    sent: list[Message]
    rendered_chars: int = 0


def _is_prefix(short: list[Message], long: list[Message]) -> bool:
    return len(short) <= len(long) and long[:len(short)] == short


class ChatSessions:
    """Per-session transcripts; records are touched from the event loop thread only."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._records: dict[str, _Record] = {}
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        return len(self._records)

    @contextlib.asynccontextmanager
    async def lock(self, session_id: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(session_id, (asyncio.Lock(), 0))
        self._locks[session_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[session_id]
            if users <= 1:
                del self._locks[session_id]
            else:
                self._locks[session_id] = (lock, users - 1)

    def plan(self, session_id: str, messages: list[Message], engine_tokens: int | None,
             tokenizer: Any = None, meta: dict[str, Any] | None = None) -> TurnPlan:
        """Decide and template the turn without changing anything (safe on a worker thread with
        that thread's ``tokenizer``). ``engine_tokens``: the engine session's length (None: absent);
        ``meta``: the record persisted with the engine's session (:meth:`meta_of`), used when this
        process has none (a restart, or another instance)."""
        tok = tokenizer or self.tokenizer
        rec = self._records.get(session_id) or (_Record.from_meta(meta, self.tokenizer) if meta else None)
        trusted = rec is not None and engine_tokens is not None and rec.expected_tokens == engine_tokens
        seen: list[Message] = list(rec.sent) if trusted and rec is not None else []
        restart = False
        if seen and len(messages) > len(seen) and messages[:len(seen)] == seen:
            new = messages[len(seen):]  # an exact extension
        elif engine_tokens and (any(m["role"] == "assistant" for m in messages)
                                or (seen and _is_prefix(messages, seen))):
            restart, new, seen = True, messages, []  # another conversation under this id
        else:
            new = messages  # new messages only
        base = rec.transcript if trusted and rec is not None and not restart else None
        transcript = ChatTranscript(tok, list(base.messages), base.seen) if base else ChatTranscript(tok)
        ids = transcript.next_turn_ids(new)  # raises ValueError for empty messages
        return TurnPlan(ids, restart, new, transcript, seen + new)

    def commit(self, session_id: str, plan: TurnPlan) -> int:
        """The engine accepted the turn: the record now holds its messages. Returns the version
        ``end_turn`` must see (a later restart or forget makes the end a no-op)."""
        old = self._records.get(session_id)
        if old is not None:
            old.previous = None  # keep one level only
        rec = _Record(ChatTranscript(self.tokenizer, plan.transcript.messages, plan.transcript.seen),
                      list(plan.sent), version=(old.version + 1) if old else 1,
                      previous=None if plan.restart else old)
        self._records[session_id] = rec
        return rec.version

    def end_turn(self, session_id: str, version: int, final: RequestOutput | None) -> None:
        """The engine ended the turn: keep it if it completed; otherwise the engine's session is as
        it was before the turn, and so is the record."""
        rec = self._records.get(session_id)
        if rec is None or rec.version != version:
            return
        reply = final.outputs[0] if final is not None and final.outputs else None
        if reply is None or reply.finish_reason not in ("stop", "length"):
            if rec.previous is not None:
                rec.previous.version = rec.version + 1
                self._records[session_id] = rec.previous
            else:
                del self._records[session_id]
            return
        rec.transcript.record_reply(reply.token_ids)
        rec.sent.append({"role": "assistant", "content": reply.text})
        rec.expected_tokens = len(final.prompt_token_ids) + len(reply.token_ids)  # type: ignore[union-attr]
        rec.version += 1

    def meta_of(self, session_id: str) -> dict[str, Any] | None:
        """The record as plain data, persisted with the engine's session so a restarted server
        (or another instance) continues the chat with the same templating."""
        rec = self._records.get(session_id)
        if rec is None:
            return None
        return {"sent": rec.sent, "messages": rec.transcript.messages, "seen": rec.transcript.seen,
                "expected_tokens": rec.expected_tokens}

    def forget(self, session_id: str) -> None:
        self._records.pop(session_id, None)

    def prune(self, live_ids: set[str]) -> int:
        """Drop records of sessions the engine no longer knows (closed, forgotten by retention)."""
        gone = [sid for sid in self._records if sid not in live_ids and sid not in self._locks]
        for sid in gone:
            del self._records[sid]
        return len(gone)
