"""Least recently freed first: a block freed long ago is reused before one freed just now."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class LRUPolicy:
    def __init__(self, initial: list[int]) -> None:
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in initial)

    def push(self, block_id: int) -> None:
        self._free[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._free[block_id]

    def touch(self, block_id: int) -> None:
        self._free.move_to_end(block_id)

    def pop(self) -> int:
        if not self._free:
            raise IndexError("no free block")
        block, _ = self._free.popitem(last=False)
        return block

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._free

    def __len__(self) -> int:
        return len(self._free)

    def __iter__(self) -> Iterator[int]:
        return iter(self._free)
