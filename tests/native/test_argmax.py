"""The native argmax (kvserve/native/argmax.py) against torch.argmax: the same index on ties,
-inf rows, NaN, bf16 and fp32, one row split over the threads and many rows, and the fallback."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.native import argmax as argmax_mod
from kvserve.native.argmax import argmax_rows

needs_ext = pytest.mark.skipif(argmax_mod._ext() is None, reason="the native argmax did not build here")
SPECIAL = [float("-inf"), float("inf"), float("nan"), 0.0, -0.0, 1.0, 3.0]


@needs_ext
@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 5), n=st.integers(1, 70_000), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**31 - 1), specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIAL)),
                                                          max_size=6), coarse=st.booleans())
def test_native_argmax_is_torch_argmax(rows, n, dtype, seed, specials, coarse):
    """Random rows (coarse: few distinct values, so the maximum repeats across lanes, parts and
    rows) with -inf, inf, NaN and signed zeros dropped in: the index torch.argmax gives."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    if coarse:
        x = x.mul(2).round()
    for pos, v in specials:
        x.view(-1)[pos % x.numel()] = v
    x = x.to(dtype)
    got = argmax_rows(x)
    assert got.dtype == torch.long and got.shape == (rows,)
    assert torch.equal(got, torch.argmax(x, dim=-1))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocabulary_wide_rows_ties_and_nan(dtype):
    """A 151,936-wide row (split over the threads): the first of two equal maxima in different
    parts, an all -inf row, a NaN after and before the maximum; 16 such rows at once; a row
    view with a stride."""
    n = 151_936
    x = torch.full((4, n), -5.0)
    x[0, 100_000] = x[0, 7] = 2.0          # equal maxima, the first in the first part
    x[1].fill_(float("-inf"))
    x[2, 5] = 9.0
    x[2, 140_000] = float("nan")
    x[3, 90_000] = float("nan")
    x[3, 91_000] = float("nan")
    x = x.to(dtype)
    assert argmax_rows(x).tolist() == [7, 0, 140_000, 90_000] == torch.argmax(x, dim=-1).tolist()
    many = torch.randn(16, n).to(dtype)
    assert torch.equal(argmax_rows(many), torch.argmax(many, dim=-1))
    wide = torch.randn(3, n + 64).to(dtype)[:, :n]  # rows strided, last dim contiguous
    assert torch.equal(argmax_rows(wide), torch.argmax(wide, dim=-1))


def test_what_the_kernel_does_not_take_runs_torch_argmax(monkeypatch):
    """fp16, a 1-d tensor, a transposed view and a build without the extension: torch.argmax."""
    x = torch.randn(3, 40)
    for t in (x.half(), x.t(), x[0:1].expand(2, 40).t()):
        assert torch.equal(argmax_rows(t), torch.argmax(t, dim=-1))
    monkeypatch.setattr(argmax_mod, "_ext", lambda: None)
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))
