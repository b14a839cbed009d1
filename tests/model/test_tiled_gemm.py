"""kvserve's tiled GEMM kernel: the packed layout, ``x @ W.T + b`` on both of its row regimes (dot
products up to 16 rows, widened panels through sgemm above), every output dtype, and a whole
bf16 model on it against transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvserve.model import tiled_gemm
from kvserve.model.gemm_apply import apply_plan, lm_head_reads_embedding
from kvserve.model.gemm_paths import candidate_paths, path_fits
from kvserve.model.gemm_plan import uniform
from kvserve.model.loader import load_model
from kvserve.model.tiled_gemm import TiledLinear, TiledMLP
from kvserve.native import fused

from .helpers import PagedRunner, check_bf16_against_transformers

pytestmark = pytest.mark.skipif(not tiled_gemm.tiled_gemm_available(), reason="no tiled kernel here (no build, or a target without AVX2 + FMA + F16C)")
Checkpoint = Callable[[str], tuple[Path, torch.nn.Module]]


def _w(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.2).to(dtype)


def test_the_module_reads_the_weight_it_was_given_not_a_copy() -> None:
    """The kernel reads W as loaded (row-major), so the tiled path and torch's matmul share it."""
    w = _w(6, 16, torch.bfloat16)
    lin = TiledLinear(w, None)
    assert lin.weight is w
    assert not any(t.data_ptr() != w.data_ptr() and t.numel() >= w.numel()
                   for t in [*lin.parameters(), *lin.buffers()])
    strided = _w(16, 6, torch.bfloat16).t()  # a transposed view: the one case that takes a contiguous copy
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(TiledLinear(strided, None, torch.float32)(x), TiledLinear(strided.contiguous(), None, torch.float32)(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 6, 8, 11, 13, 16, 17, 40, 64, 65, 127, 128, 129, 520])
@pytest.mark.parametrize(("n", "k"), [(1, 8), (6, 16), (7, 24), (130, 1032)])
def test_matches_fp32_math_on_the_half_weights(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    """Both regimes (<= 16 rows: register dots over 4-row groups, the last one short when N is not
    a multiple of 4, the rows in passes of 6, 4, 2 and 1 on the AVX512-BF16 path (8-row groups for
    one or two input rows there), which takes bf16
    inputs of up to 128 rows, every mix of which some row count here takes; more: widened panels, K sliced at 512 when it is longer; over 512 rows, the
    rows in blocks of 512) give the fp32 product of the half weights up to summation order, bias added, and
    every output dtype is that fp32 result rounded once."""
    w = _w(n, k, dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref = F.linear(x.float(), w.float(), bias)
    y32 = TiledLinear(w, bias, torch.float32)(x)
    assert y32.shape == (rows, n) and y32.dtype == torch.float32
    assert torch.allclose(y32, ref, rtol=1e-5, atol=1e-5 * (k ** 0.5))
    for out in (torch.bfloat16, torch.float16):
        y = TiledLinear(w, bias, out)(x)
        assert y.dtype == out and torch.equal(y, y32.to(out))
    assert TiledLinear(w, None)(x).dtype == dtype  # default: the input's dtype


@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 32, 33, 70, 600])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (17, 64), (45, 96), (130, 2048)])
def test_amx_shapes_match_fp32_math(rows: int, n: int, k: int) -> None:
    """Shapes the AMX tiles take where the CPU has them (bf16, K a multiple of 32): weight rows
    past a multiple of 32 (a zero-padded last panel), input rows past a multiple of 16 (zero rows
    in the packed input), odd and even numbers of 16-row input blocks, and 600 rows at K = 2,048,
    which run in three chunks of packed input. Elsewhere the same calls take the AVX512-BF16 or
    AVX2 kernel: the same function either way."""
    w = _w(n, k, torch.bfloat16, 6)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(8)).bfloat16()
    ref = F.linear(x.float(), w.float(), bias)
    y32 = TiledLinear(w, bias, torch.float32)(x)
    assert y32.shape == (rows, n)
    assert torch.allclose(y32, ref, rtol=1e-5, atol=1e-5 * (k ** 0.5))
    for out in (torch.bfloat16, torch.float16):
        assert torch.equal(TiledLinear(w, bias, out)(x), y32.to(out))
    assert torch.allclose(TiledLinear(w, None, torch.float32)(x), ref - bias, rtol=1e-5, atol=1e-5 * (k ** 0.5))


def test_amx_is_used_where_the_target_and_the_kernel_allow_it_and_switches_off() -> None:
    """The tiles are compiled in only for a target with AMX-BF16; on such a CPU the kernel runs on
    them unless ``KVSERVE_TILED_AMX=0`` (read once per process, so checked in a child), and the
    switched-off kernel computes the same function (up to summation order)."""
    import json
    import os
    import subprocess
    import sys

    from kvserve.native import target_features

    if "amx_bf16" not in target_features():
        assert not tiled_gemm._ext().amx()  # type: ignore[union-attr]
        return
    code = ("import torch; from kvserve.model import tiled_gemm as t; e = t._ext(); "
            "g = torch.Generator().manual_seed(0); w = torch.randn(40, 96, generator=g).bfloat16(); "
            "x = torch.randn(5, 96, generator=g).bfloat16(); "
            "import json; print(json.dumps([e.amx(), e.gemm(x, w, torch.empty(0), 0).tolist()]))")
    outs = {}
    for flag in ("1", "0"):
        env = {**os.environ, "KVSERVE_TILED_AMX": flag}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        used, values = json.loads(run.stdout.strip().splitlines()[-1])
        outs[flag] = (used, torch.tensor(values))
    assert outs["0"][0] is False
    if os.environ.get("KVSERVE_TILED_AMX", "1") == "1":  # this process read the same switch: the same answer
        assert outs["1"][0] is tiled_gemm._ext().amx()  # type: ignore[union-attr]
    assert torch.allclose(outs["1"][1], outs["0"][1], rtol=1e-5, atol=1e-4)


def test_the_bf16_kernel_is_a_recorded_choice() -> None:
    """What bf16 calls run on (AMX tiles, AVX512-BF16 or AVX2) is among the kernel choices that
    ``/metrics`` and ``kvserve plan --hardware cpu`` show, and agrees with the build's own flags."""
    from kvserve.native import choices

    tiled_gemm._ext.cache_clear()
    ext = tiled_gemm._ext()
    assert ext is not None
    got = {(c.role, c.band): c for c in choices.choices()}[("tiled_gemm", "bf16")]
    assert got.choice == ("amx_tiles" if ext.amx() else "avx512_bf16" if ext.bf16_dot() else "avx2")


@pytest.mark.parametrize("k", [904, 896])
@pytest.mark.parametrize("n", [8, 13, 130, 1029])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(n: int, k: int) -> None:
    """Every output of the register kernel (calls of up to 128 rows on the AVX512-BF16 path, up to
    16 on the AVX2 one; more rows go through sgemm on widened panels) is one dot product with its
    own accumulator and reduction, whichever weight group size (8 rows for one or two input rows
    on the AVX512-BF16 path, 4 otherwise) and pass the call takes: the same input row gives
    bit-equal outputs alone, in pairs, in fives and in the kernel's largest calls, so a decode
    step's result does not depend on its batch (and a batch of one equals the per-layer path's).
    K = 904 is not a multiple of 32 (the masked tail step); K = 896 is, so on an AMX CPU the calls
    run on the tiles, where each output is one tile accumulation over K whatever the call's rows."""
    w = _w(n, k, torch.bfloat16)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4))
    span = 128 if tiled_gemm._ext().bf16_dot() else 16  # type: ignore[union-attr]
    x = torch.randn(span, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    lin = TiledLinear(w, bias, torch.float32)
    whole = lin(x)
    for rows in (1, 2, 3, 5, 7 if span == 16 else 17):
        for r0 in range(0, span - rows + 1, 13 if span == 128 else 3):
            assert torch.equal(lin(x[r0:r0 + rows]), whole[r0:r0 + rows]), (rows, r0)


def test_bf16_calls_of_few_rows_use_avx512_bf16_where_the_build_targets_it() -> None:
    """The build targets this CPU (or ``KVSERVE_NATIVE_MARCH``): where the target has AVX512-BF16
    the bf16 x bf16 regime is compiled in (so the cases above ran it for bf16 inputs of up to 128
    rows); elsewhere it is not."""
    from kvserve.bench.machine import cpu_info
    from kvserve.native import march, target_features

    assert tiled_gemm._ext().bf16_dot() == ("avx512bf16" in target_features())  # type: ignore[union-attr]
    if march() == "native":
        assert ("avx512bf16" in target_features()) == ("avx512_bf16" in cpu_info()["flags"])


def test_an_fp32_or_odd_width_weight_does_not_fit() -> None:
    assert not path_fits("kvserve_tiled", torch.randn(4, 8))
    assert not path_fits("kvserve_tiled", torch.randn(4, 12).bfloat16())
    assert path_fits("kvserve_tiled", torch.randn(4, 16).bfloat16(), torch.randn(16, 8).half())
    with pytest.raises(ValueError, match="cannot hold"):
        TiledLinear(torch.randn(4, 8), None)
    assert "kvserve_tiled" in candidate_paths()


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_mlp_rounds_where_the_bf16_mlp_rounds(rows: int) -> None:
    hidden, inter = 32, 48
    gate_up, down = _w(2 * inter, hidden, torch.bfloat16, 3), _w(hidden, inter, torch.bfloat16, 4)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(5)).bfloat16()
    gu = F.linear(x.float(), gate_up.float()).bfloat16()
    act = fused.silu_mul_reference(gu, inter)  # the model's own rounding of the activation
    ref = F.linear(act.float(), down.float())
    y = TiledMLP(gate_up, down)(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, hidden)
    assert torch.allclose(y.float(), ref, rtol=2 * torch.finfo(torch.bfloat16).eps, atol=1e-3)
    with pytest.raises(ValueError, match="does not match"):
        TiledMLP(gate_up, _w(hidden, inter + 8, torch.bfloat16))


@pytest.mark.parametrize("case", ["llama-gqa", "qwen2-bias-tied"])
def test_a_model_on_the_tiled_path_matches_transformers(case: str, hf_checkpoint: Checkpoint) -> None:
    """Every projection (and the tied logits) on the kernel: prefill logits within bf16 rounding of
    transformers in bf16, a 4-row decode batch equal to each row alone to that rounding, and the
    same greedy tokens as the model on torch's own bf16 matmul."""
    path, hf = hf_checkpoint(case)
    native, config = load_model(path, dtype="bf16", cpu_fp16_gemm=False)
    model, _ = load_model(path, dtype="bf16", cpu_fp16_gemm=False)
    assert apply_plan(model, uniform("kvserve_tiled", "forced")) == 3 * config.num_hidden_layers + 1
    assert sum(isinstance(m, TiledLinear) for m in model.modules()) == 4 * config.num_hidden_layers + 1
    if case == "qwen2-bias-tied":  # the tied logits read the embedding itself: no second copy
        assert lm_head_reads_embedding(model)
    prompts = check_bf16_against_transformers(model, config, hf)
    mine, _ = PagedRunner(model, config, seed=5).greedy(prompts[1], 16)
    theirs, _ = PagedRunner(native, config, seed=5).greedy(prompts[1], 16)
    assert mine == theirs
