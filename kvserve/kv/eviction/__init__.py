"""Eviction policies: the order in which free blocks are handed out again (and lose their hash).

A policy holds the free blocks and nothing else; the pool tells it when a block becomes free
(``push``), is taken back by a hit (``remove``) and asks for the next one to reuse (``pop``).
One file per policy; ``EVICTION_POLICIES`` names them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from kvserve.kv.eviction.lru import LRUPolicy
from kvserve.kv.eviction.s3fifo import S3FIFOPolicy


class EvictionPolicy(Protocol):
    def push(self, block_id: int) -> None:
        """``block_id`` became free (its ref count reached 0)."""
        ...

    def remove(self, block_id: int) -> None:
        """A free block was taken again (a prefix hit revived it)."""
        ...

    def touch(self, block_id: int) -> None:
        """An entry was used again (a tier hit): LRU moves it to the back, S3-FIFO counts it."""
        ...

    def pop(self) -> int:
        """The free block to reuse next. Raises IndexError when none is free."""
        ...

    def __contains__(self, block_id: object) -> bool: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[int]:
        """Free blocks in eviction order (next to be reused first)."""
        ...


EVICTION_POLICIES: dict[str, type] = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}


def make_policy(name: str, initial: list[int]) -> EvictionPolicy:
    try:
        cls = EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; available: {', '.join(sorted(EVICTION_POLICIES))}") from None
    policy: EvictionPolicy = cls(initial)
    return policy


__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "LRUPolicy", "S3FIFOPolicy", "make_policy"]
