"""The host-memory tier: block objects in a dict (pinned memory on a GPU machine is the runner's
concern when it copies; the objects here are plain bytes)."""

from __future__ import annotations

from kvserve.kv.tiers.base import LocalTier


class HostTier(LocalTier):
    name = "host"

    def __init__(self, capacity_bytes: int, eviction: str = "lru") -> None:
        super().__init__(capacity_bytes, eviction)
        self._data: dict[bytes, bytes] = {}

    def put(self, key: bytes, data: bytes) -> list[bytes]:
        evicted = self._index(key, len(data))
        if key not in evicted:
            self._data[key] = data
            self.stats.saves += 1
        return evicted

    def read(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def _drop_bytes(self, key: bytes) -> None:
        data = self._data.pop(key, None)
        if self.spill is not None and data is not None:
            self.spill[key] = data
