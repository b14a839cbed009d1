"""Which blocks a window makes unreadable, and the most blocks a windowed sequence holds.

A query at position ``q`` under window ``W`` and ``S`` sinks reads keys ``k <= q`` with
``k > q - W`` or ``k < S``. The next query a request computes is at ``num_computed``, and
queries only move forward, so block ``i`` (positions ``i*bs .. (i+1)*bs - 1``) is never read
again once its last position is ``<= num_computed - W`` and it holds no sink::

    positions   0 .. S-1 | ......... dropped ......... | num_computed-W+1 .. num_computed
    blocks      [sink]     [x] [x] [x] [x]               [partly in window] ... [being written]
"""

from __future__ import annotations


def droppable(num_computed: int, block_size: int, window: int | None, sinks: int = 0) -> range:
    """Logical block indices no query from ``num_computed`` on reads (an empty range without a
    window). Sink blocks (any position ``< sinks``) are excluded: the range starts after them."""
    if window is None:
        return range(0)
    first_kept = -(-sinks // block_size)
    end = max(0, num_computed + 1 - window) // block_size  # blocks wholly at positions <= n - W
    return range(first_kept, max(first_kept, end))


def peak_blocks(num_tokens: int, block_size: int, window: int | None, chunk_tokens: int = 1,
                sinks: int = 0) -> int:
    """The most blocks a sequence of ``num_tokens`` tokens holds at once when it drops what
    :func:`droppable` says after every step of at most ``chunk_tokens`` tokens. Without a window,
    every block: ``ceil(num_tokens / block_size)``.

    A step writing positions ``p .. p + c - 1`` also reads from ``p - W + 1``: a span of
    ``W + c - 1`` positions, which touches at most ``ceil((W + c - 2) / bs) + 1`` blocks; sinks add
    their own blocks."""
    full = -(-num_tokens // block_size)
    if window is None:
        return full
    span = window + min(chunk_tokens, num_tokens) - 1
    held = -(-(span - 1) // block_size) + 1 + -(-sinks // block_size)
    return min(full, held)
