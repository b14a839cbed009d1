"""Streaming on top of :class:`LLMEngine`: one engine thread, one asyncio queue per request.

::

    event loop (HTTP handlers)                          engine thread
    ──────────────────────────                          ─────────────
    add_request() ── command ──► commands queue ──►     engine.add_request / abort / call(fn)
                  ◄── concurrent Future ─────────────   (a ValueError comes back to the caller)
    async for out in stream ◄── call_soon_threadsafe ◄─ engine.step() → RequestOutputs

torch releases the GIL inside its kernels, so the event loop keeps serving HTTP while a step runs.
``start`` lets the calling thread's OpenMP team go first (:mod:`kvserve.native.omp`). Invariants:
  * only the engine thread touches the :class:`LLMEngine` (it is not thread-safe); every other
    caller goes through a command (``add_request``, ``abort``, ``call``, ``snapshot``);
  * a stream ends with exactly one finished output, or raises; closing it early (client gone,
    task cancelled) aborts its request, so the request's blocks come back at the next step;
  * listeners run on the engine thread, after the step that produced the event: keep them short
    and thread-safe (prometheus-client metrics are)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvserve.engine.async_views import (  # noqa: F401 - re-exported: the server imports them from here
    EngineListener,
    EngineSnapshot,
    FinishedRequest,
    SessionChangedError,
    SessionInfo,
    _start_session_turn,
    session_info,
    session_infos,
    take_snapshot,
)
from kvserve.engine.engine import LLMEngine, PromptType
from kvserve.native.omp import release_team
from kvserve.request import RequestOutput
from kvserve.sampling_params import SamplingParams

log = logging.getLogger("kvserve")
T = TypeVar("T")
GIB = float(2**30)


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an error; no request can be served."""


# -- streams ---------------------------------------------------------------------------------
_DONE = object()


class RequestStream:
    """Async iterator over one request's outputs; each output carries the text so far."""

    def __init__(self, owner: AsyncLLMEngine, request_id: str, loop: asyncio.AbstractEventLoop,
                 on_done: Callable[[RequestOutput | None], None] | None = None) -> None:
        self.request_id = request_id
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._on_done = on_done
        self.finished = False

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def done_threadsafe(self, final: RequestOutput | None) -> None:
        """Run ``on_done(final)`` on the stream's loop (``None``: the engine failed), whether or not
        anybody is reading the stream."""
        if self._on_done is not None:
            self._loop.call_soon_threadsafe(self._on_done, final)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                # coalesce: several steps may have landed while we were writing to the socket
                while not item.finished and not self._queue.empty():
                    nxt = self._queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        self.finished = True
                        raise nxt
                    item = nxt
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:
                self.abort()

    async def result(self) -> RequestOutput:
        """Wait for the final output (aborting the request if the waiting task is cancelled)."""
        last: RequestOutput | None = None
        async for out in self:
            last = out
        assert last is not None and last.finished
        return last

    def abort(self) -> None:
        """Stop the request now; its blocks come back at the next engine step."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


@dataclass
class _Live:
    """Engine-thread bookkeeping of one request."""

    stream: RequestStream
    arrival: float
    num_tokens: list[int] = field(default_factory=list)     # per sample
    last_token_at: list[float] = field(default_factory=list)
    first_token_at: float | None = None
    kv_byte_s: float = 0.0


def observe(listeners: list[EngineListener], live: _Live, out: RequestOutput, now: float) -> None:
    """Tell ``listeners`` about a request's first token and its token gaps, from ``live``'s count."""
    gaps: list[float] = []
    for c in out.outputs:
        i = c.index
        new = len(c.token_ids) - live.num_tokens[i]
        if new <= 0:
            continue
        if live.num_tokens[i] > 0:
            gaps.extend([(now - live.last_token_at[i]) / new] * new)
        live.num_tokens[i], live.last_token_at[i] = len(c.token_ids), now
    if live.first_token_at is None and any(live.num_tokens):
        live.first_token_at = now
        for lis in listeners:
            lis.on_first_token(now - live.arrival, now)
    if gaps:
        for lis in listeners:
            lis.on_token_gaps(gaps, now)


@dataclass
class _Command:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any]


class AsyncLLMEngine:
    """Runs an :class:`LLMEngine` on a background thread and streams outputs to asyncio tasks."""

    def __init__(self, engine: LLMEngine, idle_tick_s: float = 1.0) -> None:
        self.engine = engine
        self.idle_tick_s = idle_tick_s
        self.listeners: list[EngineListener] = []
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._last_waiting = 0
        self._ids = 0
        self._block_bytes = engine.capacity.block_size * engine.capacity.bytes_per_token
        self._last_step_end = time.monotonic()
        self._flush = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            release_team()  # the loading thread's OpenMP team goes: the engine thread's is the only one
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self.engine.shutdown()  # the runner (a child process with runner="process")

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # -- the API -----------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests queued and not yet admitted (as of the last step), plus adds not yet applied."""
        return self._last_waiting + self._pending_adds

    def new_request_id(self, prefix: str = "req") -> str:
        with self._lock:
            self._ids += 1
            return f"{prefix}-{self._ids}"

    async def add_request(self, prompt: PromptType, params: SamplingParams, *, request_id: str | None = None,
                          session_id: str | None = None, cache_salt: str | None = None,
                          kv_cache_dtype: str | None = None, session_overflow: str | None = None,
                          tenant: str | None = None, kv_press: str | None = None,
                          restart_session: bool = False, expect_session_tokens: int | None = None,
                          check_session: bool = False,
                          cache_control: Sequence[tuple[int, float]] = (), prompt_cache_key: str | None = None,
                          on_done: Callable[[RequestOutput | None], None] | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it. Raises ValueError
        (bad input: nothing was queued) or :class:`EngineDeadError`. ``on_done(final output)`` runs
        on this event loop when the request ends, aborted or not, read or not.

        Session turns: with ``check_session`` the session must hold ``expect_session_tokens``
        tokens (None: not exist) when the turn is added, and ``restart_session`` closes it first
        (the turn starts it afresh). ``session_overflow`` overrides the engine's choice for this
        turn; ``tenant`` (the session's owner) is what the engine's per-tenant session cap counts."""
        rid = request_id or self.new_request_id()
        stream = RequestStream(self, rid, asyncio.get_running_loop(), on_done)
        arrival = time.monotonic()
        n = params.n
        extra: dict[str, Any] = {"kv_cache_dtype": kv_cache_dtype, "session_overflow": session_overflow,
                                 "kv_press": kv_press, "tenant": tenant if session_id is not None else None,
                                 "cache_control": tuple(cache_control), "prompt_cache_key": prompt_cache_key}

        def add(engine: LLMEngine) -> None:
            if session_id is not None and (check_session or restart_session):
                _start_session_turn(engine, session_id, restart_session, expect_session_tokens)
            engine.add_request(prompt, params, request_id=rid, cache_salt=cache_salt, session_id=session_id,
                               **extra)
            self._live[rid] = _Live(stream, arrival, [0] * n, [arrival] * n)
            self._last_waiting = engine.scheduler.num_waiting

        with self._lock:
            self._pending_adds += n
        try:
            await self.call(add)
        except asyncio.CancelledError:
            self.abort(rid)  # it may have been added already; nobody would read it
            raise
        finally:
            with self._lock:
                self._pending_adds -= n
        return stream

    def abort(self, request_id: str) -> None:
        """Abort from any thread (fire and forget)."""
        if self.alive:
            self._submit(lambda e: self._abort_now(e, request_id))

    def _abort_now(self, engine: LLMEngine, request_id: str) -> None:
        engine.abort_request(request_id)
        self._flush = True  # the aborted request's last output comes from the next step

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread and await its result (or exception)."""
        return await asyncio.wrap_future(self._submit(fn))

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run ``fn(engine)`` on the engine thread; nobody waits for it (fire and forget)."""
        self._submit(fn)

    def call_blocking(self, fn: Callable[[LLMEngine], T], timeout_s: float = 30.0) -> T:
        """``call`` for threads without an event loop (tests, benchmarks)."""
        return self._submit(fn).result(timeout_s)

    async def snapshot(self) -> EngineSnapshot:
        return await self.call(take_snapshot)

    async def list_sessions(self, prefix: str | None = None) -> list[SessionInfo]:
        return await self.call(lambda e: session_infos(e, prefix=prefix))

    async def session(self, session_id: str) -> SessionInfo | None:
        return await self.call(lambda e: session_info(e, session_id))

    async def session_ids(self) -> set[str]:
        return await self.call(lambda e: {s.session_id for s in e.list_sessions()})

    async def close_session(self, session_id: str) -> bool:
        return await self.call(lambda e: e.close_session(session_id))

    async def set_session_meta(self, session_id: str, meta: dict[str, Any]) -> bool:
        """Attach the front end's record (a chat transcript) to a session; persisted with it."""
        return await self.call(lambda e: e.set_session_meta(session_id, meta))

    def post_session_meta(self, session_id: str, meta: dict[str, Any]) -> None:
        """``set_session_meta`` without waiting for it."""
        self.post(lambda e: e.set_session_meta(session_id, meta))

    def _submit(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(EngineDeadError(f"the engine is not running: {self.error!r}"))
            return fut
        self._commands.put(_Command(fn, fut))
        self._wake.set()
        return fut

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._drain()
                if self.engine.has_unfinished_requests() or self._flush:
                    self._flush = False
                    self._step()
                elif self._commands.empty():
                    if not self._wake.wait(self.idle_tick_s):
                        self._step()  # idle tick: expires idle sessions, flushes aborts
                    self._last_step_end = time.monotonic()
        except BaseException as exc:  # the thread must report, not vanish
            log.exception("engine thread failed")
            self.error = exc
            self._fail_all(exc)

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if not cmd.future.set_running_or_notify_cancel():
                continue
            try:
                cmd.future.set_result(cmd.fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - goes back to the caller
                cmd.future.set_exception(exc)

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        self._account_kv(now - self._last_step_end)
        self._last_step_end = now
        self._last_waiting = self.engine.scheduler.num_waiting
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            self._observe(live, out, now)
            if out.finished:  # metrics first: a client that got its answer may scrape at once
                del self._live[out.request_id]
                self._report_finished(live, out, now)
            live.stream.put_threadsafe(out)
            if out.finished:
                live.stream.done_threadsafe(out)

    def _account_kv(self, dt: float) -> None:
        """Charge each running request for the blocks it held during the last step (dropped
        entries of its table excluded: docs/eviction.md)."""
        kv = self.engine.kv
        for req in self.engine.scheduler.running:
            live = self._live.get(req.group_id or req.request_id)
            if live is not None:
                live.kv_byte_s += kv.num_held_blocks(req.request_id) * self._block_bytes * dt

    def _observe(self, live: _Live, out: RequestOutput, now: float) -> None:
        observe(self.listeners, live, out, now)

    def _report_finished(self, live: _Live, out: RequestOutput, now: float) -> None:
        m = out.metrics
        sched = m.first_scheduled_time if m else None
        reasons = {c.finish_reason for c in out.outputs}
        fin = FinishedRequest(
            request_id=out.request_id,
            finish_reason=reasons.pop() if len(reasons) == 1 else ",".join(sorted(str(r) for r in reasons)),
            prompt_tokens=len(out.prompt_token_ids),
            generation_tokens=sum(len(c.token_ids) for c in out.outputs),
            cached_tokens=out.num_cached_tokens,
            queue_s=None if sched is None else max(0.0, sched - live.arrival),
            ttft_s=None if live.first_token_at is None else live.first_token_at - live.arrival,
            e2e_s=now - live.arrival,
            kv_gib_s=live.kv_byte_s / GIB,
            kv_hit_tokens=dict(out.kv_hit_tokens),
            cache_write_tokens=out.cache_write_tokens,
            kv_miss_tokens=dict(out.kv_miss_tokens),
        )
        for lis in self.listeners:
            lis.on_finished(fin, now)

    def _fail_all(self, exc: BaseException) -> None:
        err = EngineDeadError(f"the engine stopped: {exc!r}")
        for live in self._live.values():
            live.stream.put_threadsafe(err)
            live.stream.done_threadsafe(None)
        self._live.clear()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(err)
