"""Loads from the KV tiers, off the step's path.

A ``LoadBlock`` is handed to one background thread that reads the object from the tiers and
verifies it (the slow part: a file, a Redis round trip, a checksum) while the step's forward
runs for everyone else. The payload is written into its pool block on the runner's thread, by
:meth:`TierLoader.collect`, between forwards.

Invariants:

- a target block is written only by ``collect``, on the runner's thread, never during a forward;
- every submitted load is reported exactly once, as a :class:`LoadResult` (``tier=None`` when no
  tier held a valid object, the payload did not fit, or the read raised);
- the scheduler holds a load's target block until its result is reported (even if the request
  that asked for it is gone), so nothing else is written there meanwhile.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from kvserve.contract import LoadBlock, LoadResult, RunnerOutput
from kvserve.contract.block_ops import BlockPayload
from kvserve.contract.records import TierEvent
from kvserve.kv.block_io import import_block
from kvserve.kv.storage import KVStorage
from kvserve.kv.tiers.stack import TierStack
from kvserve.native.omp import single_thread_here

log = logging.getLogger("kvserve")
LOCAL_TIERS = ("host", "disk")  # reads bounded by memory or a local file: safe to run on the step's thread
Fetched = tuple[BlockPayload | None, str | None, list[TierEvent], float]


@dataclass
class _Pending:
    op: LoadBlock
    future: Future[Fetched]


class TierLoader:
    def __init__(self, tiers: TierStack) -> None:
        self.tiers = tiers
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-load",
                                        initializer=single_thread_here)  # no OpenMP team of its own
        self._pending: list[_Pending] = []

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, op: LoadBlock) -> None:
        self._pending.append(_Pending(op, self._pool.submit(self._fetch, op.key)))

    def _fetch(self, key: bytes) -> Fetched:
        t0 = time.perf_counter()
        try:
            payload, tier, events = self.tiers.load(key)
        except Exception as exc:  # noqa: BLE001 - a tier fault is a miss, never a failed step
            log.warning("KV tier load of %s failed: %r", key.hex()[:12], exc)
            payload, tier, events = None, None, []
        return payload, tier, events, time.perf_counter() - t0

    def collect(self, storage: KVStorage, result: RunnerOutput, wait_s: float = 0.0) -> None:
        """Write every finished load into its block and report it in ``result``. With ``wait_s``
        > 0 (a step with nothing else to do), loads from a local tier that the thread has not
        started run here, on the runner's thread, until ``wait_s`` is spent (measured: 29 host-tier
        blocks of the 0.5B model took 0.175 s handed to the thread after a forward, 0.02 s here:
        docs/benchmarks.md, KV tiers);
        a remote read (a network round trip, maybe a timeout) stays on the thread; then what is
        still running is waited for, up to ``wait_s``."""
        if not self._pending:
            return
        if wait_s > 0:
            deadline = time.monotonic() + wait_s
            for p in self._pending:
                if time.monotonic() >= deadline:
                    break
                if p.op.tier in LOCAL_TIERS and p.future.cancel():  # not started on the thread: do it now
                    p.future = Future()
                    p.future.set_result(self._fetch(p.op.key))
            while any(not p.future.done() for p in self._pending):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wait([p.future for p in self._pending], timeout=left, return_when=FIRST_COMPLETED)
        still: list[_Pending] = []
        for p in self._pending:
            if not p.future.done():
                still.append(p)
                continue
            payload, tier, events, seconds = p.future.result()
            result.tier_events += events
            if payload is not None:
                try:
                    import_block(storage, payload, p.op.block_id)
                except ValueError:
                    tier = None
            result.loaded.append(LoadResult(p.op.key, p.op.block_id, tier, seconds))
        self._pending = still

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
