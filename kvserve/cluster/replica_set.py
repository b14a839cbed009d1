"""N engine replicas (Ray actors) behind the interface the server uses of :class:`AsyncLLMEngine`.

::

    HTTP handlers ── add_request ──► fresh:   one round of polls of every live replica (its cache
                                              events + load), shared by concurrent decisions
                                     route:   policy.choose(RouteQuery, loads) → Decision
                                     stream:  replica.generate (a Ray streaming call) ──► pump task
                  ◄── RequestStream ◄──────────────────────────────────────────────────┘

Invariants:
  * the router's index is fed only by the replicas' polls, applied in order under one lock; a
    replica answering with a new epoch (Ray restarted it) or a gap is re-read from a snapshot;
  * a session's turns go to its owner while the owner is up, unless the owner has
    ``overload_waiting`` requests waiting and another replica has fewer in flight: then the
    session moves there first (its record, then its history's blocks, :func:`move_session`);
    when the owner is down, the session is looked up on the live replicas, else adopted by one
    from the shared session store;
  * a replica that dies ends each of its in-flight streams with :class:`ReplicaUnavailable`
    (a 503 the client may retry), and is dropped from routing and from the index; no stream hangs;
  * only the front end's event loop touches this object (Ray calls are awaited on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.cluster.index import BlockIndex, IndexGap
from kvserve.cluster.pd import TransferLedger, move_session, ship_prefix
from kvserve.cluster.records import Decision, ReplicaLoad, RouteQuery
from kvserve.cluster.replica import ReplicaInfo
from kvserve.cluster.replica_sessions import ReplicaSessions
from kvserve.cluster.router import KVRouter, NoReplica, RouterConfig, make_policy
from kvserve.cluster.view import EngineView
from kvserve.engine.async_engine import (
    EngineDeadError,
    EngineListener,
    RequestStream,
    _Live,
    observe,
)
from kvserve.kv.hashing import hash_full_blocks, request_root
from kvserve.request import RequestOutput
from kvserve.sampling_params import SamplingParams

log = logging.getLogger("kvserve.cluster")


class ReplicaUnavailable(EngineDeadError):
    """The replica serving a request died or no replica is up; retrying the request is safe."""


@dataclass
class _Replica:
    name: str
    handle: Any
    epoch: str
    up: bool = True
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    error: str | None = None


@dataclass(frozen=True)
class DecisionRecord:
    """One routing decision, for the offline oracle: the prompt's hashes, where it went, and each
    replica's event sequence number when it was decided."""

    block_hashes: tuple[bytes, ...]
    decision: Decision
    seqs: dict[str, int]
    num_tokens: int = 0  # the prompt's length (0: a session turn, whose history is the replica's)


def _actor_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rx

    return (rx.RayActorError, rx.ActorUnavailableError, rx.ObjectLostError)


class ReplicaSet(ReplicaSessions):
    def __init__(self, handles: dict[str, Any], infos: dict[str, ReplicaInfo], tokenizer: Any,
                 router: RouterConfig | None = None, poll_timeout_s: float = 2.0,
                 on_shutdown: Callable[[], None] | None = None, prefill: frozenset[str] = frozenset(),
                 transfer_timeout_s: float = 1.0, pd_channel: str = "direct") -> None:
        first = infos[min(infos)]
        self.info = first
        self.engine = EngineView.of(first, tokenizer)
        self.router_config = router or RouterConfig()
        self.index = BlockIndex()
        self.policy = make_policy(self.router_config, self.index)
        self.replicas = {n: _Replica(n, h, infos[n].epoch) for n, h in handles.items()}
        self.listeners: list[EngineListener] = []
        self.error: BaseException | None = None
        self.poll_timeout_s = poll_timeout_s
        self.decision_log: list[DecisionRecord] = []
        self.owners: dict[str, str] = {}        # session → replica that serves it
        self.served: dict[str, dict[str, int]] = {n: {} for n in handles}  # finished requests' figures
        self._where: dict[str, str] = {}        # in-flight request → replica
        self._pending_adds = 0
        self._ids = 0
        self._lock: asyncio.Lock | None = None
        self._poller: asyncio.Task[None] | None = None
        self._round: asyncio.Future[None] | None = None  # the decisions' poll round in flight
        self.poll_rounds = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop it serves on, once started
        self._on_shutdown = on_shutdown
        self.prefill = prefill                  # prefill replicas (a P/D split); the others decode
        self.transfers = TransferLedger()
        self.transfer_timeout_s = transfer_timeout_s
        self.pd_channel = pd_channel
        self.peer_addresses = {n: i.peer_address for n, i in infos.items()}  # direct block transfers
        self._errors = _actor_errors()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background poller (keeps loads and the index fresh between requests)."""
        if self._poller is None:
            self.loop = asyncio.get_running_loop()
            self._poller = self.loop.create_task(self._poll_forever())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        import ray

        if self._poller is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self._poller.cancel)  # shutdown may run on another thread
            self._poller = None
        for r in self.replicas.values():
            with contextlib.suppress(Exception):  # already gone
                ray.kill(r.handle, no_restart=True)
        if self._on_shutdown is not None:
            self._on_shutdown()

    @property
    def alive(self) -> bool:
        return any(r.up for r in self.replicas.values())

    def up(self) -> list[str]:
        return sorted(n for n, r in self.replicas.items() if r.up)

    @property
    def num_waiting(self) -> int:
        return sum(r.load.num_waiting for r in self.replicas.values() if r.up) + self._pending_adds

    def new_request_id(self, prefix: str = "req") -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}"

    # -- the index ---------------------------------------------------------------------------
    async def refresh(self, names: list[str] | None = None) -> None:
        """Poll replicas (default: the live ones) and apply what they report, in order."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            todo = names if names is not None else self.up()
            await asyncio.gather(*(self._refresh_one(self.replicas[n]) for n in todo))

    async def fresh(self) -> None:
        """Bring the index up to date for a decision: one round of polls, shared by every
        decision that arrives while it runs (so N concurrent requests cost one round, not N)."""
        if self._round is None:
            self._round = asyncio.ensure_future(self.refresh())
            self._round.add_done_callback(self._round_done)
            self.poll_rounds += 1
        await asyncio.shield(self._round)

    def _round_done(self, _: Any) -> None:
        self._round = None

    async def _refresh_one(self, r: _Replica) -> None:
        since = self.index.seq.get(r.name, -1)
        try:
            epoch, poll = await self._ask(r, r.handle.poll.remote(since))
            if epoch != r.epoch:  # Ray restarted it: what we knew is gone
                self.index.drop(r.name)
                r.epoch = epoch
                self.peer_addresses[r.name] = (await self._ask(r, r.handle.info.remote())).peer_address
                epoch, poll = await self._ask(r, r.handle.poll.remote(-1))
            try:
                self.index.apply(r.name, poll)
            except IndexGap:
                _, poll = await self._ask(r, r.handle.poll.remote(-1))
                self.index.apply(r.name, poll)
        except TimeoutError:
            return  # slow this round: routing uses what it knew
        except self._errors as exc:
            self._mark_down(r, exc)
            return
        if not r.up:
            log.warning("replica %s is back (epoch %s)", r.name, r.epoch[:8])
        r.up, r.load, r.error = True, poll.load, None

    async def _ask(self, r: _Replica, ref: Any) -> Any:
        return await asyncio.wait_for(ref, self.poll_timeout_s)

    def _mark_down(self, r: _Replica, exc: BaseException | str) -> None:
        if r.up:
            log.warning("replica %s is down: %s", r.name, str(exc).splitlines()[0][:200])
        r.up, r.error = False, str(exc).splitlines()[0][:200]
        self.policy.forget_replica(r.name)
        self.index.drop(r.name)
        for sid in [s for s, o in self.owners.items() if o == r.name]:
            del self.owners[sid]
        if not self.alive:
            self.error = ReplicaUnavailable(f"no replica is up (last: {r.name}: {r.error})")

    async def _poll_forever(self, every_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.refresh(sorted(self.replicas))  # down ones too: Ray may have restarted them
            except Exception:
                log.exception("replica poll failed")

    def restart_router(self) -> None:
        """Forget the index and the policy's state (as a restarted router would); the next
        refresh rebuilds the index from the replicas' snapshots. Sessions keep their owners."""
        self.index = BlockIndex()
        self.policy = make_policy(self.router_config, self.index)
        if isinstance(self.policy, KVRouter):
            self.policy.sessions.update(self.owners)

    # -- routing -----------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt", ""))
        if isinstance(prompt, str):
            return list(self.engine.tokenizer.encode(prompt, add_special_tokens=True))
        return [int(t) for t in prompt]

    def prompt_hashes(self, prompt: Any, cache_salt: str | None = None,
                      kv_cache_dtype: str | None = None) -> tuple[bytes, ...]:
        """The full-block hashes the replicas give ``prompt`` (under its salt and codec)."""
        root = request_root(self.info.root_key, kv_cache_dtype, cache_salt)
        return tuple(hash_full_blocks(self._prompt_ids(prompt), self.info.block_size, root))

    async def route(self, query: RouteQuery, pinned: str | None = None, num_tokens: int = 0) -> Decision:
        """Where ``query`` goes (``pinned``: that replica, if up; warm-ups in tests and benchmarks);
        with a P/D split, among the decode replicas unless pinned."""
        await self.fresh()
        owner = self.owners.get(query.session_id) if query.session_id is not None else None
        loads = {n: self.replicas[n].load for n in self.up() if pinned is not None or n not in self.prefill}
        if not loads:
            raise ReplicaUnavailable("no replica is up; retry later")
        try:
            if pinned is not None and pinned in loads:
                decision = Decision(pinned, "pinned", self.index.prefix(pinned, query.block_hashes))
            elif owner in loads and (busy := self._relief(owner, loads)) is not None and \
                    await move_session(self, query.session_id, owner, busy, self.transfer_timeout_s):
                decision = Decision(busy, "moved")  # off an overloaded owner, with its KV
                self.policy.decisions["moved"] += 1
            elif owner in loads:  # a live session stays where its state is
                decision = Decision(owner, "sticky")
                self.policy.decisions["sticky"] += 1
            else:
                decision = self.policy.choose(query, loads)
        except NoReplica as exc:
            raise ReplicaUnavailable(str(exc)) from None
        self.decision_log.append(DecisionRecord(query.block_hashes, decision, dict(self.index.seq), num_tokens))
        if query.session_id is not None:
            self.owners[query.session_id] = decision.replica
        return decision

    def _relief(self, owner: str, loads: dict[str, ReplicaLoad]) -> str | None:
        """The replica a session leaves its overloaded ``owner`` for, or None (not overloaded, or
        no other replica is less busy)."""
        if loads[owner].num_waiting < self.router_config.overload_waiting:
            return None
        others = [n for n in loads if n != owner]
        best = min(others, key=lambda n: (loads[n].in_flight, -loads[n].blocks_free, n), default=None)
        return best if best is not None and loads[best].in_flight < loads[owner].in_flight else None

    async def route_among(self, names: frozenset[str], hashes: tuple[bytes, ...]) -> str:
        """The policy's choice among ``names`` (the prefill replicas), without logging a decision."""
        loads = {n: self.replicas[n].load for n in self.up() if n in names}
        if not loads:
            raise ReplicaUnavailable("no prefill replica is up; retry later")
        return self.policy.choose(RouteQuery(hashes), loads).replica

    async def add_request(self, prompt: Any, params: SamplingParams, *, request_id: str | None = None,
                          session_id: str | None = None, cache_salt: str | None = None,
                          kv_cache_dtype: str | None = None, session_overflow: str | None = None,
                          tenant: str | None = None, restart_session: bool = False,
                          expect_session_tokens: int | None = None, check_session: bool = False,
                          on_done: Callable[[RequestOutput | None], None] | None = None,
                          cache_control: Sequence[tuple[int, float]] = (), prompt_cache_key: str | None = None,
                          kv_press: Any = None, routing_key: str | None = None, replica: str | None = None) -> RequestStream:
        """:meth:`AsyncLLMEngine.add_request` on the replica the router picks (``routing_key``:
        what the session-hash policy hashes when there is no session, e.g. a conversation id;
        default: the prompt-caching API's ``prompt_cache_key``; ``replica``: skip the router and
        use that one)."""
        routing_key = routing_key if routing_key is not None else prompt_cache_key
        rid = request_id or self.new_request_id()
        ids = self._prompt_ids(prompt) if session_id is None else []
        root = request_root(self.info.root_key, kv_cache_dtype, cache_salt)
        hashes = tuple(hash_full_blocks(ids, self.info.block_size, root))
        self._pending_adds += params.n
        try:
            decision = await self.route(RouteQuery(hashes, session_id, routing_key), replica, len(ids))
            if self.prefill and replica is None and session_id is None and hashes:
                await ship_prefix(self, prompt, hashes, decision.replica, cache_salt, kv_cache_dtype,
                                  self.transfer_timeout_s)
            r = self.replicas[decision.replica]
            kwargs = {"session_id": session_id, "cache_salt": cache_salt, "kv_cache_dtype": kv_cache_dtype,
                      "session_overflow": session_overflow, "tenant": tenant, "restart_session": restart_session,
                      "expect_session_tokens": expect_session_tokens, "check_session": check_session,
                      "cache_control": tuple(cache_control), "prompt_cache_key": prompt_cache_key,
                      "kv_press": kv_press}
            arrival = time.monotonic()
            gen = r.handle.generate.remote(rid, prompt, params, kwargs)
            try:
                first = await (await gen.__anext__())
            except self._errors as exc:
                self._mark_down(r, exc)
                raise ReplicaUnavailable(f"replica {r.name} died before taking the request; retry") from None
            if first[0] == "error":
                raise first[1]
        finally:
            self._pending_adds -= params.n
        stream = RequestStream(self, rid, asyncio.get_running_loop(), on_done)  # type: ignore[arg-type]
        self._where[rid] = r.name
        live = _Live(stream, arrival, [0] * params.n, [arrival] * params.n)
        asyncio.get_running_loop().create_task(self._pump(r, rid, gen, live))
        return stream

    async def _pump(self, r: _Replica, rid: str, gen: Any, live: _Live) -> None:
        stream = live.stream
        try:
            async for ref in gen:
                item = await ref
                now = time.monotonic()
                out: RequestOutput = item[1]
                observe(self.listeners, live, out, now)
                if item[0] == "final":
                    self._count(r.name, out)
                    if item[2] is not None:
                        for lis in self.listeners:
                            lis.on_finished(item[2], now)
                    stream.put_threadsafe(out)
                    stream.done_threadsafe(out)
                    return
                stream.put_threadsafe(out)
            raise ReplicaUnavailable(f"replica {r.name} ended the stream early")
        except self._errors as exc:
            self._mark_down(r, exc)
            stream.put_threadsafe(ReplicaUnavailable(
                f"replica {r.name} died while serving this request; retry it (the conversation is kept)"))
            stream.done_threadsafe(None)
        except ReplicaUnavailable as exc:
            stream.put_threadsafe(exc)
            stream.done_threadsafe(None)
        finally:
            self._where.pop(rid, None)

    def _count(self, name: str, out: RequestOutput) -> None:
        c = self.served.setdefault(name, {})
        for key, n in (("requests", 1), ("prompt_tokens", len(out.prompt_token_ids)),
                       ("cached_tokens", out.num_cached_tokens),
                       ("generation_tokens", sum(len(x.token_ids) for x in out.outputs))):
            c[key] = c.get(key, 0) + n

    def metrics_collector(self, model_name: str) -> Any:
        from kvserve.cluster.metrics import ReplicaCollector

        return ReplicaCollector(self, model_name)

    def replica_table(self) -> list[dict[str, Any]]:
        """Per replica, for the dashboard: up, load, blocks the index places there, served."""
        return [{"replica": n, "up": r.up, "error": r.error, **vars(r.load),
                 "index_blocks": {t: len(h) for t, h in self.index.held(n).items()}, **self.served.get(n, {})}
                for n, r in sorted(self.replicas.items())]

    def abort(self, request_id: str) -> None:
        name = self._where.get(request_id)
        r = self.replicas.get(name) if name is not None else None
        if r is not None and r.up:
            r.handle.abort.remote(request_id)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        raise NotImplementedError("a replica set runs no function on 'the' engine; use its named methods")

    post = call

    def run_blocking(self, coro: Any, timeout_s: float = 60.0) -> Any:
        """Run ``coro`` on the loop this set serves on, from another thread (tests, benchmarks)."""
        assert self.loop is not None, "start() the replica set first"
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)
