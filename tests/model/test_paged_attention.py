"""``paged_attention`` against a dense reference (causal, optional window, ``repeat_kv`` GQA).

Covers both paths: the batched one for single-query sequences (equal and unequal lengths, with
and without a window, caches full of NaN garbage where nothing was written) and the per-sequence
loop (prefill chunks, and decodes when the batched path is disabled).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.model import attention
from kvserve.model.attention import AttentionMetadata, paged_attention

HEADS, KV_HEADS, D, BS, NUM_BLOCKS = 6, 2, 8, 4, 64


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None) -> torch.Tensor:
    """q ``[q_len, H, D]`` at the last positions of keys/values ``[L, KVH, D]``; dense math."""
    q_len, kv_len = q.shape[0], keys.shape[0]
    g = HEADS // KV_HEADS
    k = keys.repeat_interleave(g, dim=1).transpose(0, 1)              # [H, L, D]
    v = values.repeat_interleave(g, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * D ** -0.5        # [H, q_len, L]
    qp = torch.arange(kv_len - q_len, kv_len)[:, None]
    kp = torch.arange(kv_len)[None, :]
    allowed = kp <= qp
    if window is not None:
        allowed &= kp > qp - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)                   # [q_len, H, D]


def run_case(specs: list[tuple[int, int]], window: int | None, seed: int = 0, device: str = "cpu") -> None:
    """``specs``: (context before this step, new tokens) per sequence; the attention runs on
    ``device`` (tests/cuda runs these cases on a GPU), the reference on the CPU."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.full((2, NUM_BLOCKS, BS, KV_HEADS, D), float("nan"))
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, histories, q_rows, k_new, v_new, slots, qsl, lens = [], [], [], [], [], [], [0], []
    for done, new in specs:
        total = done + new
        n = -(-total // BS)
        table, free = torch.tensor(free[:n]), free[n:]
        keys, values = torch.randn(total, KV_HEADS, D, generator=g), torch.randn(total, KV_HEADS, D, generator=g)
        for p in range(done):  # context written by earlier steps
            cache[0, table[p // BS], p % BS] = keys[p]
            cache[1, table[p // BS], p % BS] = values[p]
        tables.append(table)
        histories.append((keys, values))
        q_rows.append(torch.randn(new, HEADS, D, generator=g))
        k_new.append(keys[done:])
        v_new.append(values[done:])
        slots += [int(table[p // BS]) * BS + p % BS for p in range(done, total)]
        qsl.append(qsl[-1] + new)
        lens.append(total)
    dev = torch.device(device)
    meta = AttentionMetadata(torch.tensor(slots, device=dev), qsl, lens, [t.to(dev) for t in tables], BS, window)
    out = paged_attention(torch.cat(q_rows).to(dev), torch.cat(k_new).to(dev), torch.cat(v_new).to(dev),
                          cache.to(dev), meta, D ** -0.5).cpu()
    assert not out.isnan().any()
    for i, (keys, values) in enumerate(histories):
        ref = reference(q_rows[i], keys, values, window)
        assert torch.allclose(out[qsl[i]:qsl[i + 1]], ref, atol=1e-5), f"sequence {i}"


CASES = {
    "decodes-equal": [(9, 1), (9, 1), (9, 1)],
    "decodes-unequal": [(3, 1), (17, 1), (8, 1), (1, 1)],
    "mixed": [(0, 7), (12, 1), (5, 6), (20, 1), (0, 1)],
    "single-decode": [(13, 1)],
    "prompts": [(0, 32), (0, 2), (4, 9)],  # first chunks take torch's causal kernel (no window, or one past them)
    "later-chunks": [(30, 7), (3, 2), (16, 16), (1, 13)],  # the cascade split (no window, or one past them)
}


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_dense_reference(case: str, window: int | None) -> None:
    run_case(CASES[case], window)


def test_a_window_longer_than_the_prompt_keeps_the_causal_kernel() -> None:
    run_case([(0, 20), (0, 40)], 40)


def test_a_window_past_the_context_keeps_the_split() -> None:
    run_case(CASES["later-chunks"], 64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ctx,q_len", [(3, 5), (37, 16), (700, 65)])
def test_split_matches_the_masked_form_in_half_precision(dtype: torch.dtype, ctx: int, q_len: int) -> None:
    """The cascade split (cached part unmasked, chunk causal, merged by log-sum-exp) against the
    masked single call, in the model's own half dtype: within that dtype's rounding of the output."""
    g = torch.Generator().manual_seed(ctx)
    heads, kvh, d = 8, 2, 32
    q = torch.randn(q_len, heads, d, generator=g).to(dtype)
    k, v = (torch.randn(kvh, ctx + q_len, d, generator=g).to(dtype) for _ in range(2))
    split = attention._attend_split(q, k, v, ctx, d ** -0.5)
    masked = attention._attend(q, k, v, attention._causal_mask(q_len, ctx + q_len, None, q.device), d ** -0.5)
    exact = attention._attend(q.double(), k.double(), v.double(),
                              attention._causal_mask(q_len, ctx + q_len, None, q.device), d ** -0.5)
    assert split.dtype == dtype and split.shape == q.shape
    eps = torch.finfo(dtype).eps
    assert (split.double() - exact).abs().max() <= 4 * eps * exact.abs().max()
    assert (split.double() - exact).abs().mean() <= 2 * (masked.double() - exact).abs().mean() + eps / 8


@pytest.mark.parametrize("window", [None, 5])
def test_per_sequence_fallback_matches(monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    monkeypatch.setattr(attention, "MAX_BATCHED_DECODE_ELEMENTS", 0)
    run_case(CASES["decodes-unequal"], window)


def test_plan_is_built_once_per_step_by_the_backend_and_layers_use_it() -> None:
    """The runner builds the step's plan once (the backend's ``plan``); every layer follows it:
    a plan that sends every sequence down the per-sequence loop is obeyed (same output), and a
    plan naming no sequence leaves the output unwritten, so the layer cannot have re-planned."""
    from kvserve.model.attention import StepPlan, plan_step
    from kvserve.model.attention_backends import get_backend

    cache = torch.zeros(2, NUM_BLOCKS, BS, KV_HEADS, D)
    tables = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    meta = AttentionMetadata(torch.tensor([5, 9]), [0, 1, 2], [6, 2], tables, BS)
    backend = get_backend("torch_sdpa")
    plan = backend.plan(meta, tuple(cache.shape), torch.device("cpu"))
    again = plan_step(meta, tuple(cache.shape), torch.device("cpu"))
    assert plan.batch is not None and again.batch is not None and plan.loop == again.loop == []
    assert torch.equal(plan.batch.tables, again.batch.tables)
    q, kv = torch.randn(2, HEADS, D), torch.randn(2, KV_HEADS, D)
    batched = backend.forward(q, kv, kv, cache, AttentionMetadata(**{**meta.__dict__, "plan": plan}), 1.0)
    looped = backend.forward(q, kv, kv, cache, AttentionMetadata(**{**meta.__dict__, "plan": StepPlan(None, [0, 1])}), 1.0)
    torch.testing.assert_close(batched, looped)
    marker = AttentionMetadata(**{**meta.__dict__, "plan": StepPlan(None, [1])})
    out = backend.forward(q, kv, kv, cache, marker, 1.0)
    torch.testing.assert_close(out[1], looped[1])
    assert not torch.allclose(out[0], looped[0])  # row 0 was never attended: the given plan was used


def run_static_case(lens: list[int], window: int | None, seqs: int, blocks: int, device: str = "cpu",
                    variant: str = "sdpa") -> None:
    """The fixed-shape decode attention of CUDA graphs (``attention_static``): ``len(lens)`` decodes
    (context after the step) padded to ``seqs`` rows and ``blocks`` blocks a table, padding rows
    repeating the last real one, in a cache of NaN where nothing was written; the real rows match
    the dense reference and the pool holds exactly the real rows' new K/V."""
    from kvserve.model.attention_static import StaticDecodeBackend, static_plan

    g = torch.Generator().manual_seed(len(lens))
    dev = torch.device(device)
    cache = torch.full((2, NUM_BLOCKS, BS, KV_HEADS, D), float("nan"))
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    n = len(lens)
    rows = [min(i, n - 1) for i in range(seqs)]
    tables = torch.zeros(seqs, blocks, dtype=torch.long)
    hist, slots = [], []
    for i, total in enumerate(lens):
        nb = -(-total // BS)
        table, free = free[:nb], free[nb:]
        tables[i, :nb] = torch.tensor(table)
        keys, values = torch.randn(total, KV_HEADS, D, generator=g), torch.randn(total, KV_HEADS, D, generator=g)
        for p in range(total - 1):
            cache[0, table[p // BS], p % BS], cache[1, table[p // BS], p % BS] = keys[p], values[p]
        hist.append((keys, values))
        slots.append(table[(total - 1) // BS] * BS + (total - 1) % BS)
    tables[n:] = tables[n - 1]
    q = torch.randn(n, HEADS, D, generator=g)[rows]
    k, v = torch.stack([h[0][-1] for h in hist])[rows], torch.stack([h[1][-1] for h in hist])[rows]
    src, seq_lens = torch.tensor(rows), torch.tensor(lens)[rows]
    meta = AttentionMetadata(torch.tensor(slots)[rows].to(dev), list(range(seqs + 1)), [1] * seqs, [], BS, window)
    meta.plan = static_plan(tables.to(dev), seq_lens.to(dev), src.to(dev), BS, window)
    pool = cache.clone().to(dev)
    out = StaticDecodeBackend(variant).forward(q.to(dev), k.to(dev), v.to(dev), pool, meta, D ** -0.5).cpu()
    for i, (keys, values) in enumerate(hist):
        torch.testing.assert_close(out[i], reference(q[i:i + 1], keys, values, window)[0], atol=1e-5, rtol=1e-5)
        s = slots[i]
        assert torch.equal(pool[0].view(-1, KV_HEADS, D)[s].cpu(), keys[-1])
    written = pool.cpu().isnan().logical_not().view(2, -1, KV_HEADS * D).all(-1).sum().item()
    assert written == cache.isnan().logical_not().view(2, -1, KV_HEADS * D).all(-1).sum().item() + 2 * n


STATIC_CASES = {"equal": ([9, 9, 9], 4, 4), "unequal": ([3, 17, 8, 1], 8, 8), "one": ([13], 1, 4),
                "padded-rows": ([5, 30, 2], 8, 16)}


@pytest.mark.parametrize("variant", ["sdpa", "matmul"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("case", list(STATIC_CASES))
def test_static_decode_matches_dense_reference(case: str, window: int | None, variant: str) -> None:
    lens, seqs, blocks = STATIC_CASES[case]
    run_static_case(lens, window, seqs, blocks, variant=variant)
