"""FBGEMM fp16-weight linear layers against torch's own matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.cpu_gemm import PackedFp16Linear, fbgemm_fp16_available, pack_linears

pytestmark = pytest.mark.skipif(not fbgemm_fp16_available(), reason="no FBGEMM in this torch build")


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_linear_matches_fp32_math_on_half_weights(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(48, 40, generator=g) * 0.5).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    x = torch.randn(rows, 40, generator=g).to(dtype)
    exact = F.linear(x.float(), w.float(), b.float())           # half weights are exact in fp32
    y = PackedFp16Linear(w, b)(x)
    assert y.dtype == dtype and y.shape == (rows, 48)
    # only the fp32 summation order differs before rounding to the output dtype
    assert torch.allclose(y.float(), exact, rtol=torch.finfo(dtype).eps, atol=1e-3)
    y32 = PackedFp16Linear(w, None, out_dtype=torch.float32)(x)
    assert y32.dtype == torch.float32
    assert torch.allclose(y32, F.linear(x.float(), w.float()), atol=1e-5)


def test_pack_linears_skips_weights_beyond_fp16_range() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        model[1].weight[0, 0] = 1e5                              # would overflow fp16
    assert pack_linears(model) == 1
    assert isinstance(model[0], PackedFp16Linear) and isinstance(model[1], nn.Linear)
