"""Draft tokens by n-gram lookup in a sequence's own tokens ("prompt lookup decoding").

:class:`NgramIndex` keeps, for every n in ``[min_n, max_n]``, where each n-gram of the sequence
last ended, **excluding the sequence's own suffix** (an n-gram ending at the last position is
indexed only once a token follows it). :meth:`NgramIndex.propose` looks the sequence's last n
tokens up, longest n first, and copies the tokens that followed their most recent earlier
occurrence. When the copy runs into the sequence's end it continues with the tokens it has just
drafted (a loop of period P drafts past P tokens).

Invariant: ``propose`` only returns tokens that followed an earlier occurrence of the suffix in
the sequence (or, past its end, the periodic continuation of that copy); it never invents one.
Appending a token costs ``max_n - min_n + 1`` dict writes; proposing at most as many lookups.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.sizes = tuple(range(max_n, min_n - 1, -1))  # longest first
        self.tokens: list[int] = []
        self._last_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Iterable[int]) -> None:
        """Append tokens; the n-grams that stop being the suffix become findable."""
        toks = self.tokens
        for t in new_tokens:
            end = len(toks) - 1
            if end >= 0:
                for n in self.sizes:
                    if end + 1 >= n:
                        self._last_end[n][tuple(toks[end - n + 1:end + 1])] = end
            toks.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
        suffix (``max_n`` .. ``min_n`` tokens) found; ``[]`` when none occurred before."""
        toks = self.tokens
        size = len(toks)
        for n in self.sizes:
            if size < n:
                continue
            end = self._last_end[n].get(tuple(toks[size - n:]))
            if end is None:
                continue
            out: list[int] = []
            for i in range(k):
                idx = end + 1 + i
                out.append(toks[idx] if idx < size else out[idx - size])
            return out
        return []
