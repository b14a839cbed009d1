"""The full-precision window's slot allocator: which pool block holds which shadow slot.

Plain Python over slot and block ids (no torch); :class:`kvserve.kv.storage.KVStorage` owns the
tensors and mirrors this state into them. A *shadow* is one window slot attached to one pool
block, kept while it is needed for one of three reasons (``short``, ``tail``, ``sink``: see the
storage module) and touched by the step that last read or wrote it.

Invariants (``check()``): every slot is either free or holds exactly one block's shadow;
``shadow_of`` maps each such block to its slot; ``len(used) + len(free) == num_slots``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Shadow:
    block: int
    short: bool = False
    tail: bool = False
    sink: bool = False
    last_step: int = 0

    @property
    def needed(self) -> bool:
        return self.short or self.tail or self.sink


class ShadowWindow:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: list[Shadow | None] = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self.shadow_of: dict[int, int] = {}               # pool block -> slot

    @property
    def full(self) -> bool:
        return not self._free

    def __len__(self) -> int:
        return len(self.shadow_of)

    def get(self, block: int) -> Shadow | None:
        slot = self.shadow_of.get(block)
        return None if slot is None else self._slots[slot]

    def at(self, slot: int) -> Shadow:
        s = self._slots[slot]
        if s is None:
            raise KeyError(f"shadow slot {slot} is free")
        return s

    def allocate(self, block: int, step: int) -> int:
        """A free slot for ``block`` (which has none). The caller reclaims first when ``full``."""
        if block in self.shadow_of:
            raise RuntimeError(f"block {block} already has shadow slot {self.shadow_of[block]}")
        slot = self._free.pop()
        self._slots[slot] = Shadow(block, last_step=step)
        self.shadow_of[block] = slot
        return slot

    def drop(self, block: int) -> int:
        """Free ``block``'s slot; returns it."""
        slot = self.shadow_of.pop(block)
        self._slots[slot] = None
        self._free.append(slot)
        return slot

    def victim(self, step: int) -> Shadow | None:
        """The shadow to reclaim: an unneeded one first, else the least recently used; never one
        touched by ``step`` (that step may still read or finalize it). None if all were."""
        candidates = [s for s in self._slots if s is not None and s.last_step != step]
        if not candidates:
            return None
        return min(candidates, key=lambda s: (s.needed, s.last_step if s.needed else 0))  # ties: lowest slot

    def check(self) -> None:
        used = {slot for slot, s in enumerate(self._slots) if s is not None}
        assert used.isdisjoint(self._free) and len(used) + len(self._free) == self.num_slots, "slots lost"
        assert {self.at(slot).block: slot for slot in used} == self.shadow_of, "shadow map out of sync"
