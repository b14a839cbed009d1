"""Session records that survive the process: one JSON object per session, written at the end of
every turn, deleted when the session is closed or forgotten. Plain Python, no torch.

A record holds what a new engine needs to continue the conversation: tenant, history token ids,
turn starts, the salt its KV was computed under. The KV itself is in the tiers (its full blocks
were written through); a restarted engine lists the session, and its next turn finds the
history's blocks by hash in the disk or remote tier and loads them instead of recomputing.

``DirSessionStore``: ``<dir>/sessions/<sha256(id)>.json``, written to a temp file, fsynced and
renamed (whole or absent). ``RedisSessionStore``: one ``SET kvserve:session:<id>`` per record, so
another instance on the same Redis can take the session over.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("kvserve")


def record_of(session: Any) -> dict[str, Any]:
    return {"session_id": session.session_id, "tenant": session.tenant, "token_ids": session.token_ids,
            "turn_starts": session.turn_starts, "cache_salt": session.cache_salt, "meta": session.meta}


class SessionStore(Protocol):
    def save(self, record: dict[str, Any]) -> None: ...

    def delete(self, session_id: str) -> None: ...

    def load_all(self) -> Iterator[dict[str, Any]]: ...

    def load(self, session_id: str) -> dict[str, Any] | None: ...


class DirSessionStore:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory) / "sessions"
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, session_id: str) -> Path:
        return self.dir / (hashlib.sha256(session_id.encode()).hexdigest() + ".json")

    def save(self, record: dict[str, Any]) -> None:
        path = self._path(record["session_id"])
        tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
        with open(tmp, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def delete(self, session_id: str) -> None:
        self._path(session_id).unlink(missing_ok=True)

    def load(self, session_id: str) -> dict[str, Any] | None:
        """One record (another process may have written it since start-up), or None."""
        try:
            return json.loads(self._path(session_id).read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return None

    def load_all(self) -> Iterator[dict[str, Any]]:
        for p in sorted(self.dir.glob("*.json"), key=lambda p: p.stat().st_mtime):
            try:
                yield json.loads(p.read_text())
            except (OSError, ValueError):
                log.warning("session record %s is unreadable; ignored", p.name)
        for p in self.dir.glob(".tmp-*"):
            p.unlink(missing_ok=True)


class RedisSessionStore:
    PREFIX = "kvserve:session:"

    def __init__(self, url: str, timeout_s: float = 1.0) -> None:
        import redis

        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._errors = (redis.RedisError, OSError)

    def save(self, record: dict[str, Any]) -> None:
        try:
            self._client.set(self.PREFIX + record["session_id"], json.dumps(record))
        except self._errors as exc:
            log.warning("session record not saved to Redis: %s", exc)

    def delete(self, session_id: str) -> None:
        try:
            self._client.delete(self.PREFIX + session_id)
        except self._errors:
            pass

    def load(self, session_id: str) -> dict[str, Any] | None:
        try:
            v = self._client.get(self.PREFIX + session_id)
        except self._errors as exc:
            log.warning("session record not read from Redis: %s", exc)
            return None
        return None if v is None else json.loads(v)  # type: ignore[no-any-return]

    def load_all(self) -> Iterator[dict[str, Any]]:
        try:
            keys = list(self._client.scan_iter(match=self.PREFIX + "*", count=1000))
            values = self._client.mget(keys) if keys else []
        except self._errors as exc:
            log.warning("session records not read from Redis: %s", exc)
            return
        for v in values:
            if v is not None:
                yield json.loads(v)


def attach_session_stores(table: Any, cache: Any) -> int:
    """Give a session table the stores ``cache`` (a CacheConfig) configures, and restore the
    sessions they hold (the disk's first, then the remote's). Returns how many were restored."""
    if cache.kv_disk_dir is not None:
        table.stores.append(DirSessionStore(cache.kv_disk_dir))
    if cache.kv_remote is not None:
        table.stores.append(RedisSessionStore(cache.kv_remote))
    return sum(table.restore(store.load_all()) for store in table.stores)
