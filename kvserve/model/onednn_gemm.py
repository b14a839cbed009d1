"""oneDNN's matmul on a weight reordered once into its own blocked layout (the ``onednn_packed``
GEMM path).

torch's plain ``F.linear`` on a bf16 weight hands oneDNN the row-major matrix, which it reorders
into its AMX/AVX-512 blocked layout on every call: a decode reads and rewrites each weight. Here
the weight is reordered once at load (``torch.ops.mkldnn._reorder_linear_weight``, what torch's
CPU inductor does for frozen weights) and every call runs ``torch.ops.mkldnn._linear_pointwise``
on it. Measured on a 2-core AMX Xeon (0.5B gate/up matrix, weights past the cache, µs per call,
``benchmarks/cpu_ops.py``): 770-825 against 1,135-1,176 at one row, 766-819 against 1,327-1,412 at 4-16 rows,
i.e. at the memory bound at both (docs/kernels.md). The reordered tensor replaces the loaded one (same bytes; its layout is
oneDNN's, so no other path can read it).

Offered only where oneDNN multiplies bf16 natively (AMX or AVX-512 BF16) and only for bf16
weights. Numerics: oneDNN's bf16 GEMM with fp32 accumulation, as ``F.linear``; output rounded to
bf16 (the logits then widened to fp32, as the native path does). Invariant: a module computes
``x @ W.T + b`` for every row count.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kvserve.model.row_blocks import in_row_blocks
from kvserve.model.tiled_gemm import TiledMLP

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
REORDER_ROWS = 16
"""The batch-size hint the weight is reordered for (measured: 1, 16 and 512 give the same speed
within 10 % at 1-2,048 rows)."""


@functools.cache
def onednn_packed_available() -> bool:
    """Whether this torch has the ops, the CPU multiplies bf16 natively, and a tiny call works."""
    from kvserve.bench.machine import cpu_info

    if not torch.backends.mkldnn.is_available() or not set(NATIVE_BF16_FLAGS) & set(cpu_info()["flags"]):  # type: ignore[arg-type]
        return False
    try:
        w = torch.ones(16, 32, dtype=torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 32, dtype=torch.bfloat16),
                                               torch.ops.mkldnn._reorder_linear_weight(w, REORDER_ROWS),
                                               None, "none", [], "")
        return bool(torch.equal(y, torch.full((2, 16), 32.0, dtype=torch.bfloat16)))
    except (RuntimeError, AttributeError):
        return False


def fits(weight: torch.Tensor) -> bool:
    """A 2-D bf16 matrix, on a machine where the path exists."""
    return weight.dim() == 2 and weight.dtype == torch.bfloat16 and onednn_packed_available()


class OneDNNLinear(nn.Module):
    """``y = x @ W.T + b`` on W reordered for oneDNN (the loaded weight is not kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not fits(weight):
            raise ValueError(f"onednn_packed cannot hold a {weight.dtype} {tuple(weight.shape)} weight here")
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), REORDER_ROWS)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16).contiguous(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, in]`` -> ``[T, out]``."""
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16).contiguous(), self.packed, self.bias,
                                               "none", [], "")
        return y if self.out_dtype is None else y.to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 onednn-packed"


class OneDNNMLP(TiledMLP):
    """``down(silu(gate(x)) * up(x))`` on reordered weights (:class:`TiledMLP`'s form on
    :class:`OneDNNLinear`), in blocks of 512 rows."""

    linear = OneDNNLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_row_blocks(super().forward, x)
