"""oneDNN's matmul on a weight reordered once (the ``onednn_packed`` GEMM path): ``x @ W.T + b``
for every row count, the MLP, and a whole model against transformers. Runs where the path exists
(an AMX or AVX-512 BF16 CPU); elsewhere the path is not a candidate, which is tested too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvserve.bench.machine import cpu_info
from kvserve.model import onednn_gemm
from kvserve.model.gemm_apply import apply_plan, lm_head_reads_embedding
from kvserve.model.gemm_paths import candidate_paths, path_fits
from kvserve.model.gemm_plan import uniform
from kvserve.model.loader import load_model
from kvserve.model.onednn_gemm import OneDNNLinear, OneDNNMLP
from kvserve.native import fused

from .helpers import PagedRunner, check_bf16_against_transformers

Checkpoint = Callable[[str], tuple[Path, torch.nn.Module]]
available = onednn_gemm.onednn_packed_available()
needs_onednn = pytest.mark.skipif(not available, reason="no AMX / AVX-512 BF16 here: the path is not offered")


def test_offered_exactly_where_the_cpu_multiplies_bf16() -> None:
    native_bf16 = bool(set(onednn_gemm.NATIVE_BF16_FLAGS) & set(cpu_info()["flags"]))  # type: ignore[arg-type]
    assert available == (native_bf16 and torch.backends.mkldnn.is_available())
    assert ("onednn_packed" in candidate_paths()) == available
    assert not path_fits("onednn_packed", torch.randn(4, 8))  # fp32: never
    assert not path_fits("onednn_packed", torch.randn(4, 8).half())


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 3, 16, 17, 600])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_torchs_matmul(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(40, 24, generator=g) * 0.2).bfloat16()
    b = torch.randn(40, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 24, generator=g).bfloat16()
    lin = OneDNNLinear(w, b)
    assert lin.packed.is_mkldnn and all(t is not w for t in lin.buffers())  # an opaque reordered copy replaces it
    want = F.linear(x, w, b)
    got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 40)
    assert torch.allclose(got.float(), want.float(), rtol=2 * torch.finfo(torch.bfloat16).eps, atol=1e-2)
    assert OneDNNLinear(w, b, torch.float32)(x).dtype == torch.float32


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 530])
def test_mlp_rounds_where_the_bf16_mlp_rounds(rows: int) -> None:
    g = torch.Generator().manual_seed(1)
    hidden, inter = 32, 48
    gate_up, down = torch.randn(2 * inter, hidden, generator=g).bfloat16(), torch.randn(hidden, inter, generator=g).bfloat16()
    x = torch.randn(rows, hidden, generator=g).bfloat16()
    want = F.linear(fused.silu_mul(F.linear(x, gate_up), inter), down)
    got = OneDNNMLP(gate_up, down)(x)
    assert torch.allclose(got.float(), want.float(), rtol=2 * torch.finfo(torch.bfloat16).eps, atol=2e-2)
    with pytest.raises(ValueError, match="does not match"):
        OneDNNMLP(gate_up, torch.randn(hidden, inter + 8).bfloat16())


@needs_onednn
@pytest.mark.parametrize("case", ["llama-gqa", "qwen2-bias-tied"])
def test_a_model_on_the_path_matches_transformers(case: str, hf_checkpoint: Checkpoint) -> None:
    """Every projection (and the tied logits, on a reordered copy of the embedding) on the path:
    logits within bf16 rounding of transformers, and the greedy tokens of torch's own matmul."""
    path, hf = hf_checkpoint(case)
    native, config = load_model(path, dtype="bf16", cpu_fp16_gemm=False)
    model, _ = load_model(path, dtype="bf16", cpu_fp16_gemm=False)
    assert apply_plan(model, uniform("onednn_packed", "forced")) == 3 * config.num_hidden_layers + 1
    assert sum(isinstance(m, OneDNNLinear) for m in model.modules()) == 4 * config.num_hidden_layers + 1
    assert not lm_head_reads_embedding(model)
    prompts = check_bf16_against_transformers(model, config, hf)
    mine, _ = PagedRunner(model, config, seed=5).greedy(prompts[1], 16)
    theirs, _ = PagedRunner(native, config, seed=5).greedy(prompts[1], 16)
    assert mine == theirs
