"""kvserve's own GEMM for bf16/fp16 weights on AVX2 CPUs (the ``kvserve_tiled`` GEMM path).

The kernel (``kvserve/native/csrc/tiled_gemm.cpp``, built on first use like the other native
extensions) reads each weight as loaded: row-major, in its own dtype, no repacked copy. So a role
can run this path in one row band and torch's matmul in another on the same tensor (the GEMM plan
splits bands between the two at no memory cost), and a tied logits projection reads the embedding
itself. A decode step's few rows (up to 16) run as register-blocked dot products over groups of 4
weight rows, widened in registers (on AVX512-BF16 CPUs, bf16 inputs of up to 128 rows: ``vdpbf16ps``
on 6 input rows a pass, no widening), the next group prefetched into L2 line by line, split over
torch's intra-op threads (OpenMP: a fork costs microseconds, against ~50-75 us for the Python pool
FBGEMM's shards need); more rows widen L2-sized panels to fp32 and multiply them with MKL's sgemm,
512 rows at a time. Measured one row (``benchmarks/gemm_plan.py``): on a 2-core AMD EPYC (AVX2)
0.44-0.93x FBGEMM fp16's time on a layer's matrices and 0.65x on the logits projection (session
7's packed layout); on a 2-core Xeon with AMX 0.55-0.84x torch's plain (oneDNN) matmul, which is
1.8-11x faster from 16 rows up (docs/kernels.md).

On a CPU with AMX-BF16 (``amx_gemm.h``, session 21), bf16 x bf16 calls with the input size a
multiple of 32 run on AMX tiles at every row count, still on the loaded tensor (the product is
taken transposed, so the weight rows are the tiles' A operand as they lie): on the 2-core AMX
Xeon the 0.5B shape's matrices at one row in 0.64-0.97x the time of oneDNN's reordered copy and
0.73-0.88x the AVX512-BF16 kernel's, 16-128 rows in 0.63-0.98x oneDNN's (``benchmarks/gemm_plan.py``),
so the GEMM plan keeps one storage per role with no copy and decode ran 1.28x faster
(``benchmarks/throughput.py``, engine ``kvserve-noamx``). ``KVSERVE_TILED_AMX=0`` switches the tiles off (read once per process).

:class:`TiledMLP` (two linears around :func:`fused.silu_mul`) names its linear in ``linear``, so
:class:`~kvserve.model.onednn_gemm.OneDNNMLP` reuses it on its own.

Numerics: fp32 products and sums, bias added in fp32, one rounding to the output dtype; the
weights are not rounded at all (FBGEMM rounds bf16 to fp16). Only the summation order differs from
torch's bf16 matmul. Invariant: a module computes ``x @ W.T + b`` for every row count.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch
from torch import nn

from kvserve.native import extensions, fused
from kvserve.native.choices import KernelChoice, record

_OUT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def _ext() -> ModuleType | None:
    mod = extensions.load(extensions.TILED_GEMM)
    mod = mod if mod is not None and mod.available() else None
    if mod is not None:
        forced = os.environ.get("KVSERVE_TILED_AMX", "").strip() != ""
        record(KernelChoice("tiled_gemm", "bf16", bf16_kernel(mod), {}, "forced" if forced else "default"))
    return mod


def bf16_kernel(mod: ModuleType) -> str:
    """What the built kernel runs bf16 x bf16 calls on: ``amx_tiles`` (K a multiple of 32; other
    K as the next), ``avx512_bf16`` (up to 128 rows; more through sgemm) or ``avx2``. Recorded
    as the ``tiled_gemm`` kernel choice (``/metrics``, ``kvserve plan --hardware cpu``)."""
    return "amx_tiles" if mod.amx() else "avx512_bf16" if mod.bf16_dot() else "avx2"


def tiled_gemm_available() -> bool:
    """Whether the kernel built here and this CPU has AVX2, FMA and F16C."""
    return _ext() is not None


def fits(weight: torch.Tensor) -> bool:
    """Whether the path can hold this weight: a 2-D bf16/fp16 matrix whose input size is a multiple of 8."""
    return weight.dim() == 2 and weight.dtype in (torch.bfloat16, torch.float16) and weight.shape[1] % 8 == 0


class TiledLinear(nn.Module):
    """``y = x @ W.T + b`` on the kernel, over ``W`` itself (the tensor given, not a copy).

    The output is ``out_dtype`` or, when ``None``, the input's dtype.
    """

    bias: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        ext = _ext()
        if ext is None or not fits(weight):
            raise ValueError(f"kvserve_tiled cannot hold a {weight.dtype} {tuple(weight.shape)} weight here")
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        self.weight = weight if weight.is_contiguous() else nn.Parameter(weight.contiguous(), requires_grad=False)
        self.register_buffer("bias", torch.empty(0) if bias is None else bias.detach().float().contiguous(),
                             persistent=False)
        self._gemm = ext.gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, in]`` -> ``[T, out]``."""
        out = self.out_dtype or x.dtype
        return self._gemm(x, self.weight, self.bias, _OUT_CODE[out])  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.weight.dtype} tiled"


class TiledMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` on the kernel, rounding where torch's bf16 MLP rounds (the
    gate/up output and the activation in the model dtype)."""

    linear: type[nn.Module] = TiledLinear

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        if gate_up.shape != (2 * down.shape[1], down.shape[0]):
            raise ValueError(f"gate_up {tuple(gate_up.shape)} does not match down {tuple(down.shape)}")
        self.gate_up = self.linear(gate_up, None)
        self.down = self.linear(down, None)
        self.inter = down.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(fused.silu_mul(self.gate_up(x), self.inter))  # type: ignore[no-any-return]
