"""Fast matmuls for half-precision weights on CPUs without native bf16/fp16 arithmetic.

On x86 CPUs without AVX-512 BF16 (e.g. AMD Zen 3, most AVX2 machines), torch 2.13 multiplies
bf16/fp16 matrices with a fallback that does one matrix-vector product per input row: a batch of
16 decodes costs 16 single decodes and a 512-token prefill runs at ~9 GFLOP/s. FBGEMM's fp16
GEMM (``torch.fbgemm_linear_fp16_weight_fp32_activation``) reads weights stored as fp16, widens
them in registers and accumulates in fp32: close to memory bandwidth for one row and fast for
many (measured on this repo's 2-core AMD EPYC: 4x faster at one row, 6x at 16, 7x at 256).

:func:`pack_linears` swaps a model's ``nn.Linear`` layers (and the logits projection) for
:class:`PackedFp16Linear`. Numerics: a bf16 weight is exactly representable in fp16 unless its
magnitude is above 65504 (such layers are left unpacked) or below ~6e-5 (fp16 subnormals; absolute
error under 3e-8); products accumulate in fp32 and the output is rounded to the activation dtype,
as a bf16 GEMM with fp32 accumulation would. Only the summation order differs.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

FP16_MAX = 65504.0


@functools.cache
def fbgemm_fp16_available() -> bool:
    """True when this torch build has FBGEMM's fp16-weight GEMM (x86 CPU builds do)."""
    if not hasattr(torch, "fbgemm_pack_gemm_matrix_fp16"):
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            packed = torch.fbgemm_pack_gemm_matrix_fp16(torch.ones(2, 2))
            torch.fbgemm_linear_fp16_weight_fp32_activation(torch.ones(1, 2), packed, torch.zeros(2))
    except RuntimeError:
        return False
    return True


class PackedFp16Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` packed for FBGEMM's fp16 GEMM (CPU only).

    ``out_features`` rows; output dtype is ``out_dtype`` or, when ``None``, the input's dtype.
    The packed matrix is an opaque buffer (not a parameter, not in the state dict).
    """

    packed: torch.Tensor
    bias: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "deprecated" notice; torch is pinned to 2.13
            packed = torch.fbgemm_pack_gemm_matrix_fp16(weight.detach().float().contiguous())
        self.register_buffer("packed", packed, persistent=False)
        b = torch.zeros(self.out_features) if bias is None else bias.detach().float()
        self.register_buffer("bias", b, persistent=False)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether every weight is within fp16 range (packing would overflow otherwise)."""
        return bool(weight.detach().abs().max().item() <= FP16_MAX)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, in]`` -> ``[T, out]``."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = torch.fbgemm_linear_fp16_weight_fp32_activation(x.float(), self.packed, self.bias)
        return y.to(self.out_dtype or x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp16 packed"


def pack_linears(model: nn.Module, logits_weight: torch.Tensor | None = None) -> int:
    """Replace every CPU ``nn.Linear`` in ``model`` (in place) with a :class:`PackedFp16Linear`;
    returns how many were packed. Layers with weights beyond fp16 range stay as they are."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" and PackedFp16Linear.fits(child.weight):
                out_dtype = torch.float32 if name == "lm_head" else None
                setattr(parent, name, PackedFp16Linear(child.weight, child.bias, out_dtype))
                count += 1
    return count
