"""Attention under eviction (sinks, a window, dropped blocks, block scores) against dense math.

A dropped block's cache rows are NaN: reading one would poison the output, so a finite output
equal to the reference proves it was skipped. Cases cover chunks whose later queries lose keys to
the window while earlier ones do not (where sinks must already apply), decodes batched with
dropped blocks inside their window, and the per-block scores a policy reads.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.model.attention import AttentionMetadata, paged_attention

HEADS, KV_HEADS, D, BS, NUM_BLOCKS = 4, 2, 8, 4, 64


def allowed_mask(q_len: int, kv_len: int, window: int | None, sinks: int, dropped: set[int]) -> torch.Tensor:
    qp = torch.arange(kv_len - q_len, kv_len)[:, None]
    kp = torch.arange(kv_len)[None, :]
    ok = kp <= qp
    if window is not None:
        ok &= (kp > qp - window) | (kp < sinks)
    for b in dropped:
        ok &= (kp // BS) != b
    return ok


def dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = HEADS // KV_HEADS
    k = keys.repeat_interleave(g, dim=1).transpose(0, 1)
    v = values.repeat_interleave(g, dim=1).transpose(0, 1)
    probs = (q.transpose(0, 1) @ k.transpose(1, 2) * D ** -0.5).masked_fill(~ok, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1), probs                         # [q, H, D], [H, q, L]


# (context done, new tokens, window, sinks, dropped logical blocks, score queries)
CASES = {
    "chunk-window-starts-mid-chunk": [(6, 6, 10, 4, set(), 0)],   # queries 10, 11 lose keys 0-1: sinks apply
    "chunk-sinks-and-holes": [(20, 5, 8, 4, {1, 2, 3}, 0)],
    "decodes-with-holes-batched": [(17, 1, None, 0, {1, 3}, 0), (9, 1, None, 0, {0}, 0), (12, 1, None, 0, set(), 0)],
    "decode-sinks": [(30, 1, 6, 3, {1, 2, 3, 4, 5}, 0), (30, 1, None, 0, set(), 0)],
    "scores": [(14, 3, None, 0, {1}, 2), (9, 1, None, 0, set(), 1)],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kept_keys_match_dense_reference(case: str) -> None:
    g = torch.Generator().manual_seed(0)
    cache = torch.full((2, NUM_BLOCKS, BS, KV_HEADS, D), float("nan"))
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    specs = CASES[case]
    tables, data, qs, kn, vn, slots, qsl, lens = [], [], [], [], [], [], [0], []
    for done, new, _w, _s, dropped, _sc in specs:
        total = done + new
        n = -(-total // BS)
        table, free = torch.tensor(free[:n]), free[n:]
        keys, values = torch.randn(total, KV_HEADS, D, generator=g), torch.randn(total, KV_HEADS, D, generator=g)
        for p in range(done):
            if p // BS not in dropped:  # a dropped block keeps its NaN: it must never be read
                cache[0, table[p // BS], p % BS], cache[1, table[p // BS], p % BS] = keys[p], values[p]
        tables.append(table)
        data.append((keys, values))
        qs.append(torch.randn(new, HEADS, D, generator=g))
        kn.append(keys[done:])
        vn.append(values[done:])
        slots += [int(table[p // BS]) * BS + p % BS for p in range(done, total)]
        qsl.append(qsl[-1] + new)
        lens.append(total)
    meta = AttentionMetadata(torch.tensor(slots), qsl, lens, tables, BS, None,
                             seq_windows=[s[2] for s in specs], seq_sinks=[s[3] for s in specs],
                             dropped=[frozenset(s[4]) for s in specs], score_queries=[s[5] for s in specs])
    out = paged_attention(torch.cat(qs), torch.cat(kn), torch.cat(vn), cache, meta, D ** -0.5)
    assert not out.isnan().any()
    for i, (done, new, window, sinks, dropped, scored) in enumerate(specs):
        keys, values = data[i]
        ref, probs = dense(qs[i], keys, values, allowed_mask(new, done + new, window, sinks, dropped))
        assert torch.allclose(out[qsl[i]:qsl[i + 1]], ref, atol=1e-5), f"sequence {i}"
        if scored:
            mass = probs[:, new - scored:].sum(dim=(0, 1))            # [L] attention each key received
            per_block = torch.zeros(-(-(done + new) // BS)).index_add_(0, torch.arange(done + new) // BS, mass)
            assert torch.allclose(meta.block_scores[i], per_block, atol=1e-4)
            assert all(meta.block_scores[i][b] == 0 for b in dropped)
        else:
            assert i not in meta.block_scores  # no scores where no policy asked
