"""The GEMM paths a projection can run on, and the modules that run them.

A *role* is one kind of matrix of the decoder: ``qkv`` (fused q/k/v projection), ``o`` (attention
output), ``mlp`` (the fused gate/up projection, SiLU·mul and the down projection, one unit because
FBGEMM runs them as one sharded op) and ``lm_head`` (the logits projection). A *path* is how its
matmuls run:

=================  ===================================================================================
``native``         torch's matmul in the model dtype (oneDNN: AMX or AVX-512-BF16 where the CPU has
                   them; a slow per-row fallback on AVX2 CPUs); the weight stays as loaded
``fbgemm_fp16_x1`` FBGEMM's fp16-weight GEMM, one shard on the calling thread (:mod:`cpu_gemm`)
``fbgemm_fp16_xN`` the same, output rows split over N threads (N = ``torch.get_num_threads()``)
``fbgemm_fp16``    the same, sharded by :mod:`cpu_gemm`'s size rule (the untimed default)
``onednn_packed``  oneDNN's matmul on the bf16 weight reordered once into its blocked layout
                   (:mod:`kvserve.model.onednn_gemm`; AMX / AVX-512 BF16 CPUs only)
``kvserve_tiled``  kvserve's own kernel on the weight as loaded (the same tensor as ``native``;
                   :mod:`kvserve.model.tiled_gemm`): AVX2, AVX512-BF16, or AMX tiles where the CPU
                   has them; split over torch's intra-op threads
=================  ===================================================================================

Every path holds the weight once, in 2 bytes per element (an FBGEMM packed copy replaces the
loaded one; ``native`` and ``kvserve_tiled`` both read the loaded tensor, :func:`storage_of`): a
role whose bands take paths of different storage holds two copies of its weights
(:mod:`kvserve.model.gemm_plan` decides when that is allowed); bands split between ``native`` and
``kvserve_tiled`` cost nothing. Invariant: every path of a role
computes the same function of its input up to fp32 summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model import onednn_gemm, tiled_gemm
from kvserve.model.cpu_gemm import PackedFp16Linear, PackedFp16MLP, fbgemm_fp16_available
from kvserve.model.onednn_gemm import OneDNNLinear, OneDNNMLP
from kvserve.model.row_blocks import in_row_blocks
from kvserve.model.tiled_gemm import TiledLinear, TiledMLP
from kvserve.native import fused

ROLES = ("qkv", "o", "mlp", "lm_head")
BANDS = ("rows<=1", "rows<=16", "rows<=64", "rows<=128", "rows>128")
BAND_ROWS = (1, 16, 64, 96, 256)
"""The row count each band is measured at: one decode, a small batch (or a speculative verify),
a mid-size batch (17-64 decodes: the tiled kernel's AVX512-BF16 rows beat torch's matmul there on
a Zen 4 by 1.2-1.5x, which a 16/256 split could not see; band added in session 10), a chat turn's
chunk (65-128 rows, session 18: a turn of 64 new tokens ran on the tiled kernel and one of 65 on
torch's matmul, 1.25x the time), prompts."""
BAND_LIMITS = (1, 16, 64, 128)
"""The most rows each band but the last takes."""


def band_of(rows: int) -> int:
    """The index into :data:`BANDS` for a call with ``rows`` input rows."""
    return next((b for b, most in enumerate(BAND_LIMITS) if rows <= most), len(BAND_LIMITS))


def candidate_paths(threads: int | None = None) -> tuple[str, ...]:
    """The paths worth timing on this build: native always; FBGEMM where the build has it
    (sharded when more than one thread runs); kvserve's tiled kernel where it built."""
    n = threads if threads is not None else torch.get_num_threads()
    tiled = ("kvserve_tiled",) if tiled_gemm.tiled_gemm_available() else ()
    tiled += ("onednn_packed",) if onednn_gemm.onednn_packed_available() else ()
    if not fbgemm_fp16_available():
        return ("native",) + tiled
    return ("native", "fbgemm_fp16_x1") + ((f"fbgemm_fp16_x{n}",) if n > 1 else ()) + tiled


def storage_of(path: str) -> str:
    """What holds a role's weights on ``path``: ``loaded`` (the checkpoint's tensor itself) or the
    path's own packed copy. Two paths of one storage share the tensor."""
    return "loaded" if path in ("native", "kvserve_tiled") else path


def _shards(path: str) -> int | None:
    return int(path.rpartition("_x")[2]) if "_x" in path else None


class NativeMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with torch matmuls on the given weights (no copy), in
    blocks of :data:`~kvserve.model.row_blocks.ROW_BLOCK` rows."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.down = down
        self.inter = down.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_row_blocks(self._rows, x)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(fused.silu_mul(F.linear(x, self.gate_up), self.inter), self.down)


class NativeLinear(nn.Module):
    """``x @ W.T + b`` in the weight's dtype; ``out_dtype`` rounds the output (the logits are fp32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if self.out_dtype is None else y.to(self.out_dtype)


def build_linear(path: str, weight: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype | None = None) -> nn.Module:
    """A module running ``x @ weight.T + bias`` on ``path``."""
    if path == "native":
        return NativeLinear(weight, bias, out_dtype)
    if path == "kvserve_tiled":
        return TiledLinear(weight, bias, out_dtype)
    if path == "onednn_packed":
        return OneDNNLinear(weight, bias, out_dtype)
    return PackedFp16Linear(weight, bias, out_dtype, shards=_shards(path))


def build_mlp(path: str, gate_up: torch.Tensor, down: torch.Tensor) -> nn.Module:
    """A module running the gated MLP over ``gate_up`` ``[2I, H]`` and ``down`` ``[H, I]`` on ``path``."""
    if path == "native":
        return NativeMLP(gate_up, down)
    if path == "kvserve_tiled":
        return TiledMLP(gate_up, down)
    if path == "onednn_packed":
        return OneDNNMLP(gate_up, down)
    return PackedFp16MLP(gate_up, down, shards=_shards(path))


def path_fits(path: str, *weights: torch.Tensor) -> bool:
    """Whether ``path`` can hold these weights (fp16 packing needs every value within fp16 range;
    the tiled kernel a bf16/fp16 matrix with an input size a multiple of 8; oneDNN's packing a bf16 one)."""
    if path == "kvserve_tiled":
        return all(tiled_gemm.fits(w) for w in weights)
    if path == "onednn_packed":
        return all(onednn_gemm.fits(w) for w in weights)
    return path == "native" or all(PackedFp16Linear.fits(w) for w in weights)


class BandDispatch(nn.Module):
    """Runs each call on the path chosen for its row count's band.

    ``paths`` holds each distinct path's module once; ``band_path[b]`` is the index into ``paths``
    for band ``b`` (see :data:`BANDS`). Invariant: every path computes the same function.
    """

    def __init__(self, paths: list[nn.Module], band_path: tuple[int, ...], names: tuple[str, ...]) -> None:
        super().__init__()
        self.paths = nn.ModuleList(paths)
        self.band_path = band_path
        self.names = names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.paths[self.band_path[band_of(x.shape[0])]](x)

    def extra_repr(self) -> str:
        return ", ".join(f"{b}: {n}" for b, n in zip(BANDS, self.names))
