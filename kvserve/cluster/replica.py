"""One engine replica: an :class:`AsyncLLMEngine` inside a Ray actor, with its cache feed.

The class is plain Python; :func:`kvserve.cluster.launch.start_replicas` wraps it with
``ray.remote``. Everything it returns is plain data (records, ``RequestOutput``s, exceptions).

``generate`` is an async generator (a Ray streaming call): it yields ``("accepted",)`` once the
engine took the request, or ``("error", exc)`` (a ValueError: nothing was queued), then
``("out", RequestOutput)`` per step and ``("final", RequestOutput, FinishedRequest | None)`` last.

Invariants:
  * the feed sees every pool and tier change from construction on (it is seeded with what the
    tiers held at start-up), so ``poll(-1)`` is the replica's whole block map;
  * ``epoch`` changes each time the actor is (re)constructed: a router that sees a new epoch
    drops what it knew and takes a snapshot;
  * ``adopt_session`` makes a session another replica served continue here from the shared
    session store and tier (Redis), or answers None; it never overwrites a session known here.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvserve.cluster.feed import ReplicaFeed
from kvserve.cluster.records import ReplicaLoad, ReplicaPoll
from kvserve.config import EngineConfig
from kvserve.engine import kv_transfer
from kvserve.engine.async_engine import AsyncLLMEngine, EngineSnapshot, FinishedRequest, SessionInfo
from kvserve.engine.async_views import session_info, session_infos
from kvserve.engine.engine import LLMEngine
from kvserve.native.choices import choices
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class ReplicaInfo:
    """What the front end needs to know about the engines (the same for every replica)."""

    name: str
    root_key: bytes
    block_size: int
    num_blocks: int
    bytes_per_token: int
    token_capacity: int
    max_model_len: int
    vocab_size: int
    eos_ids: tuple[int, ...]
    tiers: tuple[str, ...]
    pid: int
    epoch: str
    peer_address: str = ""  # tcp://host:port where its runner takes direct block transfers
    kernel_choices: tuple[Any, ...] = ()  # kvserve.native.choices: what its runner measured and runs


class _Finished:
    """Listener that keeps each request's :class:`FinishedRequest` until ``generate`` sends it."""

    def __init__(self) -> None:
        self.by_id: dict[str, FinishedRequest] = {}

    def on_first_token(self, ttft_s: float, now: float) -> None:
        pass

    def on_token_gaps(self, gaps_s: list[float], now: float) -> None:
        pass

    def on_finished(self, req: FinishedRequest, now: float) -> None:
        self.by_id[req.request_id] = req


class Replica:
    def __init__(self, name: str, config: EngineConfig, idle_tick_s: float = 0.2) -> None:
        self.name = name
        self.epoch = uuid.uuid4().hex
        engine = LLMEngine(config)
        hub = getattr(engine.runner, "peers", None)
        if hub is not None:  # the direct channel listens on this node's address, not on every interface
            hub.host = _node_ip()
        self.peer_address = hub.address() if hub is not None else ""
        self.feed = ReplicaFeed()
        for tier in engine.kv.tiers.index.tiers:
            for key in engine.kv.tiers.index.held(tier):
                self.feed.tier_change("stored", tier, key)
        engine.kv.pool.subscribe(self.feed.on_pool_event)
        engine.kv.tiers.subscribers.append(self.feed.on_tier_events)
        self.engine = AsyncLLMEngine(engine, idle_tick_s=idle_tick_s)
        self._finished = _Finished()
        self.engine.listeners.append(self._finished)
        self.engine.start()

    def info(self) -> ReplicaInfo:
        e = self.engine.engine
        cap = e.capacity
        return ReplicaInfo(self.name, e.kv.root_key, cap.block_size, cap.num_blocks, cap.bytes_per_token,
                           cap.token_capacity, e.max_model_len, int(e.model_config.vocab_size), tuple(e._eos),
                           tuple(e.kv.tiers.index.tiers), os.getpid(), self.epoch, self.peer_address,
                           tuple(choices()))

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams,
                       kwargs: dict[str, Any]) -> AsyncIterator[tuple[Any, ...]]:
        try:
            stream = await self.engine.add_request(prompt, params, request_id=request_id, **kwargs)
        except ValueError as exc:  # SessionChangedError included: the front end re-raises it
            yield ("error", exc)
            return
        yield ("accepted",)
        async for out in stream:
            if out.finished:
                yield ("final", out, self._finished.by_id.pop(request_id, None))
            else:
                yield ("out", out)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def load(self) -> ReplicaLoad:
        e = self.engine.engine
        return ReplicaLoad(len(e.scheduler.running), self.engine.num_waiting, e.kv.pool.num_free,
                           e.kv.pool.num_blocks)

    def poll(self, since: int) -> tuple[str, ReplicaPoll]:
        """(epoch, the feed's events after ``since`` or a snapshot, and the load)."""
        return self.epoch, self.feed.poll(since, self.load())

    def events(self) -> list[Any]:
        return self.feed.all_events()

    def alive(self) -> bool:
        return self.engine.alive

    async def snapshot(self) -> EngineSnapshot:
        return await self.engine.snapshot()

    async def list_sessions(self, prefix: str | None = None) -> list[SessionInfo]:
        return await self.engine.list_sessions(prefix)

    async def session(self, session_id: str) -> SessionInfo | None:
        return await self.engine.session(session_id)

    async def close_session(self, session_id: str) -> bool:
        return await self.engine.close_session(session_id)

    async def set_session_meta(self, session_id: str, meta: dict[str, Any]) -> bool:
        return await self.engine.call(lambda e: e.set_session_meta(session_id, meta))

    async def adopt_session(self, session_id: str) -> SessionInfo | None:
        return await self.engine.call(lambda e: _adopt(e, session_id))

    # -- moving KV between replicas (kvserve.cluster.pd) --------------------------------------
    async def begin_receive(self, transfer: str, hashes: list[bytes], peer: str) -> list[bytes]:
        """Hold blocks for the hashes after this replica's own leading hits; returns those hashes."""
        return await self.engine.call(lambda e: kv_transfer.begin_receive(e, transfer, hashes, peer))

    async def finish_receive(self, transfer: str, frames: list[bytes] | None) -> int:
        return await self.engine.call(lambda e: kv_transfer.finish_receive(e, transfer, frames))

    async def abandon_receive(self, transfer: str) -> None:
        await self.engine.call(lambda e: kv_transfer.abandon_receive(e, transfer))

    async def send_blocks(self, transfer: str, hashes: list[bytes], peer: str,
                          timeout_s: float) -> tuple[list[bytes], tuple[int, int]]:
        """(the frames for an object-store peer, (blocks, bytes) sent): two Ray returns, so the
        frames can go to the receiver by reference."""
        frames, n, nbytes = await self.engine.call(
            lambda e: kv_transfer.send_blocks(e, transfer, hashes, peer, timeout_s))
        return frames, (n, nbytes)

    async def move_out(self, session_id: str) -> dict[str, Any] | None:
        return await self.engine.call(lambda e: kv_transfer.move_out(e, session_id))

    async def forget_moved(self, session_id: str) -> bool:
        return await self.engine.call(lambda e: kv_transfer.forget_moved(e, session_id))

    async def move_in(self, record: dict[str, Any]) -> bool:
        return await self.engine.call(lambda e: kv_transfer.move_in(e, record))


def _node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # noqa: BLE001 - not in a Ray worker
        return "127.0.0.1"


def _adopt(engine: LLMEngine, session_id: str) -> SessionInfo | None:
    """Engine thread: restore ``session_id`` from this engine's session stores if it is not
    known here; its history's blocks are then looked up in the remote tier on its next turn."""
    table = engine.kv.sessions
    if table.get(session_id) is None:
        for store in table.stores:
            record = store.load(session_id)
            if record is not None and table.restore([record]):
                engine.kv.expect_remote_history()
                break
    return session_info(engine, session_id) if table.get(session_id) is not None else None


__all__ = ["Replica", "ReplicaInfo", "session_infos"]
