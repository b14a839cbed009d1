"""The disk tier: one file per block object, written atomically; the directory is the index.

``<dir>/<hash hex>.kvb`` holds one object (:mod:`kvserve.kv.tiers.object_format`). A write goes to
``<dir>/.tmp-<pid>-<n>`` first, is flushed and fsynced, then renamed over the final name, so a file
with the final name is always a whole object (a crash leaves at most a temp file, deleted at the
next start). At start the index is rebuilt from a directory scan (names and sizes, no reads), in
LRU order of the files' modification times; an object's checksum is verified when it is read,
and a corrupt one is deleted and counted.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

from kvserve.kv.tiers.base import LocalTier

SUFFIX = ".kvb"


class DiskTier(LocalTier):
    name = "disk"

    def __init__(self, directory: str | Path, capacity_bytes: int, eviction: str = "lru", fsync: bool = True) -> None:
        super().__init__(capacity_bytes, eviction)
        self.dir = Path(directory) / "blocks"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._tmp = itertools.count()
        t0 = time.perf_counter()
        self.rebuilt = self._rebuild()
        self.rebuild_seconds = time.perf_counter() - t0

    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def _rebuild(self) -> int:
        """Index every whole object in the directory (oldest first); delete leftover temp files."""
        found: list[tuple[float, bytes, int]] = []
        with os.scandir(self.dir) as it:
            for entry in it:
                if entry.name.startswith(".tmp-"):
                    os.unlink(entry.path)
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(entry.name[: -len(SUFFIX)])
                except ValueError:
                    continue
                st = entry.stat()
                found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            for victim in self._index(key, size):
                if victim == key:
                    self._path(key).unlink(missing_ok=True)
        return len(self)

    def put(self, key: bytes, data: bytes) -> list[bytes]:
        evicted = self._index(key, len(data))
        if key in evicted:
            return evicted
        tmp = self.dir / f".tmp-{os.getpid()}-{next(self._tmp)}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self._path(key))
        except OSError:
            tmp.unlink(missing_ok=True)
            self._forget(key)
            self.stats.errors += 1
            return [*evicted, key]
        self.stats.saves += 1
        return evicted

    def read(self, key: bytes) -> bytes | None:
        if key not in self:
            return None
        try:
            return self._path(key).read_bytes()
        except OSError:  # evicted meanwhile, or unreadable: a miss
            return None

    def _drop_bytes(self, key: bytes) -> None:
        path = self._path(key)
        if self.spill is not None:
            try:
                self.spill[key] = path.read_bytes()
            except OSError:
                pass
        path.unlink(missing_ok=True)
