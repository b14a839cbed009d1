"""The replica set's fan-out calls: snapshots added up, sessions kept with their owner, the
replicas' event logs (for the oracle), and killing a replica's process (tests, chaos).

A mixin of :class:`~kvserve.cluster.replica_set.ReplicaSet` (it reads ``replicas``, ``owners``,
``up()`` and ``_mark_down``; everything runs on the set's event loop).

Invariants: a session has at most one owner, a replica that is up; a replica that fails a call
is marked down (and loses its sessions) instead of failing the caller; ``session`` never returns
a session another live replica has a longer history of.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvserve.cluster.snapshots import merge_snapshots
from kvserve.engine.async_engine import EngineSnapshot, SessionInfo


class ReplicaSessions:
    replicas: dict[str, Any]
    owners: dict[str, str]
    _errors: tuple[type[BaseException], ...]

    def up(self) -> list[str]:
        raise NotImplementedError

    def _mark_down(self, r: Any, exc: BaseException | str) -> None:
        raise NotImplementedError

    async def _each(self, method: str, *args: Any) -> dict[str, Any]:
        """``method(*args)`` on every live replica; the ones that fail are marked down."""
        names = self.up()
        results = await asyncio.gather(*(getattr(self.replicas[n].handle, method).remote(*args) for n in names),
                                       return_exceptions=True)
        out = {}
        for n, res in zip(names, results, strict=True):
            if isinstance(res, self._errors):
                self._mark_down(self.replicas[n], res)
            elif isinstance(res, BaseException):
                raise res
            else:
                out[n] = res
        return out

    async def snapshot(self) -> EngineSnapshot:
        snaps = await self._each("snapshot")
        if not snaps:
            raise _unavailable("no replica is up")
        return merge_snapshots([snaps[n] for n in sorted(snaps)])

    async def replica_snapshots(self) -> dict[str, EngineSnapshot]:
        return await self._each("snapshot")

    async def list_sessions(self, prefix: str | None = None) -> list[SessionInfo]:
        found = await self._each("list_sessions", prefix)
        by_id: dict[str, SessionInfo] = {}
        for n in sorted(found):
            for s in found[n]:
                if s.session_id not in by_id or self.owners.get(s.session_id) == n:
                    by_id[s.session_id] = s
        return list(by_id.values())

    async def session(self, session_id: str) -> SessionInfo | None:
        """The session as its owner knows it; without a live owner, whichever live replica knows
        it becomes the owner, else the least loaded one adopts it from the shared store."""
        owner = self.owners.get(session_id)
        if owner is not None and self.replicas[owner].up:
            try:
                return await self.replicas[owner].handle.session.remote(session_id)  # type: ignore[no-any-return]
            except self._errors as exc:
                self._mark_down(self.replicas[owner], exc)
        known = {n: s for n, s in (await self._each("session", session_id)).items() if s is not None}
        if known:
            n = max(known, key=lambda k: (known[k].num_tokens, k))
            self.owners[session_id] = n
            return known[n]
        up = self.up()
        if not up:
            raise _unavailable("no replica is up; retry later")
        target = min(up, key=lambda n: (self.replicas[n].load.in_flight, n))
        info: SessionInfo | None = await self.replicas[target].handle.adopt_session.remote(session_id)
        if info is not None:
            self.owners[session_id] = target
        return info

    async def replica_events(self) -> dict[str, list[Any]]:
        """Every live replica's whole cache-event log (the oracle's input)."""
        return await self._each("events")

    async def kill_replica_process(self, name: str) -> int:
        """SIGKILL a replica's process (tests, chaos): returns its pid."""
        import os
        import signal

        info = await self.replicas[name].handle.info.remote()
        os.kill(info.pid, signal.SIGKILL)
        return int(info.pid)

    async def session_ids(self) -> set[str]:
        return {s.session_id for s in await self.list_sessions()}

    async def close_session(self, session_id: str) -> bool:
        closed = await self._each("close_session", session_id)
        self.owners.pop(session_id, None)
        return any(closed.values())

    async def set_session_meta(self, session_id: str, meta: dict[str, Any]) -> bool:
        owner = self.owners.get(session_id)
        if owner is None or not self.replicas[owner].up:
            return False
        try:
            return await self.replicas[owner].handle.set_session_meta.remote(session_id, meta)  # type: ignore[no-any-return]
        except self._errors as exc:
            self._mark_down(self.replicas[owner], exc)
            return False

    def post_session_meta(self, session_id: str, meta: dict[str, Any]) -> None:
        owner = self.owners.get(session_id)
        if owner is not None and self.replicas[owner].up:
            self.replicas[owner].handle.set_session_meta.remote(session_id, meta)


def _unavailable(msg: str) -> Exception:
    from kvserve.cluster.replica_set import ReplicaUnavailable

    return ReplicaUnavailable(msg)
