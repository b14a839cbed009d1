"""Importance policies at block granularity: which held blocks to drop, from attention scores.

Plain Python (no torch). Scores are one float per logical block: the attention the scored
queries paid that block's keys, summed over heads, queries and layers (the runner computes them
in the attention itself, only for requests whose policy asks: ``ScheduledChunk.score_queries``).

Whole blocks, not tokens: a dropped block goes straight back to the pool (no compaction copy, no
per-slot position map, the block table stays a list of block ids), and a block keeps meaning
"these tokens' KV", so shared prefix blocks and their hashes stay valid. The cost is coarser
choice: a block with one important token is kept whole.

Never dropped: sink blocks (a position ``< sink_tokens``), the blocks holding the last
``recent_tokens`` computed tokens, blocks not yet full, and blocks another holder shares
(``shared[i]``): dropping a shared block frees nothing, so the policy leaves it alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvserve.kv.press.spec import PressSpec


def candidates(spec: PressSpec, held: Sequence[bool], shared: Sequence[bool], num_computed: int,
               block_size: int) -> list[int]:
    """Logical blocks a policy may drop now."""
    first = -(-spec.sink_tokens // block_size)
    last = max(0, num_computed - spec.recent_tokens) // block_size  # blocks wholly before the recent tokens
    return [i for i in range(first, min(last, len(held))) if held[i] and not shared[i]]


def lowest(scores: Sequence[float], pool: list[int], n: int) -> list[int]:
    """The ``n`` blocks of ``pool`` with the lowest scores (ties: the older block first)."""
    return sorted(sorted(pool, key=lambda i: (scores[i] if i < len(scores) else 0.0, i))[:max(0, n)])


def snapkv_drops(spec: PressSpec, scores: Sequence[float], held: Sequence[bool], shared: Sequence[bool],
                 num_prompt: int, block_size: int) -> list[int]:
    """At the end of the prompt: drop ``ratio`` of the prompt's blocks, the least attended by
    the prompt's last queries (SnapKV's observation window)."""
    total = -(-num_prompt // block_size)
    return lowest(scores, candidates(spec, held, shared, num_prompt, block_size), int(spec.ratio * total))


def h2o_drops(spec: PressSpec, scores: Sequence[float], held: Sequence[bool], shared: Sequence[bool],
              num_computed: int, block_size: int) -> list[int]:
    """While decoding: keep at most ``1 - ratio`` of the blocks so far, evicting the ones with
    the least accumulated attention (heavy hitters stay)."""
    budget = math.ceil((1.0 - spec.ratio) * len(held) - 1e-9)
    excess = sum(held) - max(1, budget)
    if excess <= 0:
        return []
    return lowest(scores, candidates(spec, held, shared, num_computed, block_size), excess)
