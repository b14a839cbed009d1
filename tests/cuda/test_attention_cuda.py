"""Paged attention on a GPU against the dense reference: the eager path's cases (decode batches,
prefill chunks, later chunks, windows, NaN where nothing was written) and the fixed-shape decode
attention of CUDA graphs (tests/model/test_paged_attention.py runs the same cases on the CPU)."""

from __future__ import annotations

import pytest

from tests.model.test_paged_attention import CASES, STATIC_CASES, run_case, run_static_case

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_on_cuda_matches_dense_reference(case: str, window: int | None) -> None:
    run_case(CASES[case], window, device="cuda")


@pytest.mark.parametrize("variant", ["sdpa", "matmul"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("case", list(STATIC_CASES))
def test_static_decode_on_cuda_matches_dense_reference(case: str, window: int | None, variant: str) -> None:
    lens, seqs, blocks = STATIC_CASES[case]
    run_static_case(lens, window, seqs, blocks, device="cuda", variant=variant)
