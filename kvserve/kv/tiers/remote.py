"""The remote tier: block objects in Redis, one ``SET`` of one value per block (never two keys).

Redis unreachable: the tier goes *down* (``up == False``), logs once, answers every ``get`` with a
miss and drops every ``put``, and tries again after an exponential backoff (0.5 s doubling to
30 s); the engine keeps serving from its local tiers. Capacity and eviction are Redis's own
(``maxmemory`` with an LRU ``maxmemory-policy``); ``nbytes`` counts what this process wrote.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from kvserve.kv.tiers.base import TierStats

log = logging.getLogger("kvserve")
PREFIX = b"kvserve:blk:"


class RemoteTier:
    name = "remote"

    def __init__(self, url: str, capacity_bytes: int = 0, timeout_s: float = 1.0,
                 clock: Any = time.monotonic) -> None:
        import redis

        self.url = url
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self.clock = clock
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._errors = (redis.RedisError, OSError)
        self._down_until: float | None = None
        self._backoff = 0.5
        self._nbytes = 0
        self._logged = False

    @property
    def up(self) -> bool:
        if self._down_until is None:
            return True
        if self.clock() >= self._down_until:
            return self._probe()
        return False

    def _probe(self) -> bool:
        try:
            self._client.ping()
        except self._errors:
            self._fail()
            return False
        log.info("KV tier remote (%s) is reachable again", self.url)
        self._down_until, self._backoff, self._logged = None, 0.5, False
        return True

    def _fail(self) -> None:
        self.stats.errors += 1
        if not self._logged:
            log.warning("KV tier remote (%s) unreachable; serving from local tiers, retrying with backoff", self.url)
            self._logged = True
        self._down_until = self.clock() + self._backoff
        self._backoff = min(30.0, self._backoff * 2)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def put(self, key: bytes, data: bytes) -> list[bytes]:
        if not self.up:
            return [key]
        try:
            self._client.set(PREFIX + key, data)
        except self._errors:
            self._fail()
            return [key]
        self._nbytes += len(data)
        self.stats.saves += 1
        return []

    def get(self, key: bytes) -> bytes | None:
        data = self.read(key)
        self.note_read(key, data)
        return data

    def read(self, key: bytes) -> bytes | None:
        if not self.up:
            return None
        try:
            data = self._client.get(PREFIX + key)
        except self._errors:
            self._fail()
            return None
        return None if data is None else bytes(data)

    def note_read(self, key: bytes, data: bytes | None) -> None:
        if data is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1

    def delete(self, key: bytes) -> None:
        if self.up:
            try:
                self._client.delete(PREFIX + key)
            except self._errors:
                self._fail()

    def keys(self) -> Iterable[bytes]:
        return []
