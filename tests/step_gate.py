"""A gate the test controls between an engine's steps, so that "a request is still running" is a
fact the test arranged rather than a bet on how fast the machine is.

While the gate is closed and a request is unfinished, ``LLMEngine.step`` does nothing (returns no
outputs): the engine thread of an :class:`~kvserve.engine.async_engine.AsyncLLMEngine` keeps running
commands (adds, aborts, calls, snapshots), but no request advances. With nothing unfinished a step
runs as usual (it only reports aborts and expires sessions), so an abort's last output still comes. ``allow(n)`` lets exactly ``n`` real steps through;
``open()`` lets every step through. Leaving the ``with`` block opens the gate and restores the
engine's own ``step``.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any, Self

from kvserve.engine.engine import LLMEngine


class StepGate:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.steps_taken = 0  # real steps run through the gate
        self._permits = 0
        self._open = False
        self._lock = threading.Lock()
        self._had_own: Any = None

    def __enter__(self) -> Self:
        self._had_own = self.engine.__dict__.get("step")
        self._real = self.engine.step
        self.engine.step = self._step  # type: ignore[method-assign]
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.open()
        if self._had_own is None:
            del self.engine.step
        else:
            self.engine.step = self._had_own  # type: ignore[method-assign]

    def allow(self, n: int = 1) -> None:
        with self._lock:
            self._permits += n

    def open(self) -> None:
        with self._lock:
            self._open = True

    def close(self) -> None:
        with self._lock:
            self._open, self._permits = False, 0

    def _step(self) -> list[Any]:
        if self.engine.has_unfinished_requests():  # else nothing can advance: report aborts, expire sessions
            with self._lock:
                go = self._open or self._permits > 0
                if go and not self._open:
                    self._permits -= 1
            if not go:
                time.sleep(0.002)  # the engine thread loops while requests are unfinished: do not spin
                return []
        out = self._real()
        self.steps_taken += 1
        return out

    def wait_steps(self, n: int, timeout_s: float = 60.0) -> None:
        """Block until ``n`` real steps have run through the gate in total."""
        deadline = time.monotonic() + timeout_s
        while self.steps_taken < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {self.steps_taken} of {n} engine steps ran in {timeout_s} s")
            time.sleep(0.002)
