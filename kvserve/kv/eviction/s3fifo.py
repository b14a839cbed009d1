"""S3-FIFO (Yang et al., SOSP 2023): a small FIFO for new entries, a main FIFO for those used
again, and a ghost list of recently evicted keys. One-hit entries (a document read once, a
benchmark's unique prompts) leave through the small queue without pushing out what is reused
(system prompts, live conversations); LRU lets such a scan flush everything.

* ``push(k)``: a ghost-listed key goes to main, others to small (frequency 0);
* ``touch(k)``: frequency + 1 (at most 3), no reordering (cheap: no list surgery on a hit);
* ``pop()``: while small holds more than 10 % of the entries, its oldest goes (to main if it was
  used again, else to the ghost list and out); otherwise main's oldest goes, or is kept one more
  round (frequency − 1) if it was used since.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

SMALL_SHARE = 0.1


class S3FIFOPolicy:
    def __init__(self, initial: list[Hashable]) -> None:
        self._small: OrderedDict[Hashable, None] = OrderedDict((k, None) for k in initial)
        self._main: OrderedDict[Hashable, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[Hashable, int] = dict.fromkeys(initial, 0)

    def push(self, key: Hashable) -> None:
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: Hashable) -> None:
        if key in self._freq:
            self._freq[key] = min(3, self._freq[key] + 1)

    def remove(self, key: Hashable) -> None:
        del self._freq[key]
        if key in self._small:
            del self._small[key]
        else:
            del self._main[key]

    def pop(self) -> Hashable:
        if not self._freq:
            raise IndexError("nothing to evict")
        while True:
            if self._small and (len(self._small) > SMALL_SHARE * len(self._freq) or not self._main):
                key, _ = self._small.popitem(last=False)
                if self._freq[key] > 0:
                    self._freq[key] = 0
                    self._main[key] = None
                    continue
                self._ghost[key] = None
                while len(self._ghost) > max(1, len(self._freq)):
                    self._ghost.popitem(last=False)
            else:
                key, _ = self._main.popitem(last=False)
                if self._freq[key] > 0:
                    self._freq[key] -= 1
                    self._main[key] = None
                    continue
            del self._freq[key]
            return key

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def __iter__(self) -> Iterator[Hashable]:
        return iter([*self._small, *self._main])
