"""FBGEMM fp16-weight linear layers against torch's own matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.cpu_gemm import PackedFp16Linear, PackedFp16MLP, fbgemm_fp16_available, pack_linears

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


@pytest.mark.parametrize("shards", [2, 3, 7])
@pytest.mark.parametrize("rows", [1, 9])
def test_sharded_linear_equals_one_shard(shards: int, rows: int) -> None:
    """Row blocks on several threads: every output is still one dot product over the whole input."""
    g = torch.Generator().manual_seed(shards)
    w = (torch.randn(50, 24, generator=g) * 0.5).to(torch.bfloat16)
    b = torch.randn(50, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 24, generator=g).to(torch.bfloat16)
    one = PackedFp16Linear(w, b, torch.float32, shards=1)
    many = PackedFp16Linear(w, b, torch.float32, shards=shards)
    assert many.shards == shards and one.shards == 1
    y = many(x)
    assert y.shape == (rows, 50)
    assert torch.allclose(y, one(x), atol=1e-5, rtol=1e-6)
    assert torch.allclose(y, F.linear(x.float(), w.float(), b.float()), atol=1e-5, rtol=1e-6)


def test_small_matrices_stay_in_one_shard_unless_asked() -> None:
    w = torch.randn(8, 8)
    assert PackedFp16Linear(w, None).shards == 1
    assert PackedFp16Linear(w, None, shards=4).shards == 4
    assert PackedFp16Linear(w, None, shards=100).shards == 8            # at most one row per shard


@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_mlp_matches_the_gated_mlp(shards: int, dtype: torch.dtype) -> None:
    """gate/up sharded by rows, down by columns, partial sums added: the gated MLP's result up to
    the fp32 summation order of the down projection (bf16: the activation is rounded as the model
    rounds it, so the result is within one ulp of the half dtype)."""
    g = torch.Generator().manual_seed(11)
    hidden, inter = 32, 40
    gate_up = (torch.randn(2 * inter, hidden, generator=g) * 0.3).to(dtype)
    down = (torch.randn(hidden, inter, generator=g) * 0.3).to(dtype)
    x = torch.randn(5, hidden, generator=g).to(dtype)
    gu = F.linear(x.float(), gate_up.float()).to(dtype)
    ref = F.linear((F.silu(gu[:, :inter]) * gu[:, inter:]).float(), down.float()).to(dtype)
    mlp = PackedFp16MLP(gate_up, down, shards=shards)
    y = mlp(x)
    assert y.dtype == dtype and y.shape == (5, hidden) and mlp.shards == shards
    assert torch.allclose(y.float(), ref.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-4)


def test_packed_mlp_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="does not match"):
        PackedFp16MLP(torch.randn(10, 4), torch.randn(4, 6))
