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

Threads: torch calls FBGEMM's fp16 GEMM on the calling thread only (one core, whatever
``torch.get_num_threads()`` says). A layer packed with ``shards=S`` splits its output features into
S row blocks, packs each, and runs them on S threads (the caller plus S - 1 pool threads; the op
releases the GIL), then concatenates: ``python benchmarks/kernels.py`` measures 2 shards making all
of a 0.5B model's GEMMs 1.32x faster at one row, 1.72x at 16 rows and 1.49x at 256. Each output element is still one dot product over the whole
input, so sharding changes no numbers. :class:`PackedFp16MLP` shards a whole gated MLP the way
tensor parallelism does (gate/up by output rows, down by input columns, partial sums added), so one
hand-off covers three matmuls and the activation; only the down projection's fp32 summation order
changes.
"""

from __future__ import annotations

import functools
import itertools
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from torch import nn

from kvserve.native import fused
from kvserve.native.omp import single_thread_here

# torch 2.13 marks the FBGEMM fp16 ops deprecated (a once-per-process UserWarning); torch is pinned.
# A filter for that message only, instead of catch_warnings() per call (not thread-safe, and on
# the decode path).
warnings.filterwarnings("ignore", message=r"fbgemm_\w+ is deprecated", category=UserWarning)

FP16_MAX = 65504.0
MIN_SHARD_ELEMENTS = 1 << 21
"""Matrices smaller than this (in weight elements) stay in one shard: a hand-off to a pool thread
costs ~50-75 us here, more than splitting a matrix under ~4 MiB saves at one row."""

_Part = TypeVar("_Part")  # one shard's packed matrices (and, for the MLP, its width)

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_workers = 0


def _gemm_pool(workers: int) -> ThreadPoolExecutor:
    """The process-wide pool that runs shards 1..S-1 (grown, never shrunk, on demand; a replaced
    pool finishes what it was given, then its threads exit). Its threads never open an OpenMP team
    (:func:`~kvserve.native.omp.single_thread_here`: a team of their own slowed every other)."""
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvserve-gemm",
                                       initializer=single_thread_here)
            _pool_workers = workers
        return _pool


def _on_threads(fn: Callable[[_Part], torch.Tensor], parts: Sequence[_Part]) -> list[torch.Tensor]:
    """``[fn(p) for p in parts]``, the first on the calling thread and the others on the pool, at once."""
    if len(parts) == 1:
        return [fn(parts[0])]
    futures = [_gemm_pool(len(parts) - 1).submit(fn, p) for p in parts[1:]]
    first = fn(parts[0])
    return [first] + [f.result() for f in futures]


def _fp16_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.fbgemm_linear_fp16_weight_fp32_activation(x, packed, bias)


@functools.cache
def fbgemm_fp16_available() -> bool:
    """True when this torch build has FBGEMM's fp16-weight GEMM (x86 CPU builds do)."""
    if not hasattr(torch, "fbgemm_pack_gemm_matrix_fp16"):
        return False
    try:
        packed = torch.fbgemm_pack_gemm_matrix_fp16(torch.ones(2, 2))
        torch.fbgemm_linear_fp16_weight_fp32_activation(torch.ones(1, 2), packed, torch.zeros(2))
    except RuntimeError:
        return False
    return True


class PackedFp16Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` packed for FBGEMM's fp16 GEMM (CPU only).

    ``out_features`` rows; output dtype is ``out_dtype`` or, when ``None``, the input's dtype.
    ``shards`` (default: ``torch.get_num_threads()`` when built) row blocks of the weight run on
    that many threads; matrices under :data:`MIN_SHARD_ELEMENTS` use one. The packed matrices are
    opaque buffers (not parameters, not in the state dict). Invariant: the shards' row counts sum
    to ``out_features`` and their order is the weight's row order.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
                 shards: int | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        want = shards if shards is not None else torch.get_num_threads()
        if weight.numel() < MIN_SHARD_ELEMENTS and shards is None:
            want = 1
        n = max(1, min(want, self.out_features))
        w = weight.detach()
        b = torch.zeros(self.out_features) if bias is None else bias.detach().float()
        bounds = [self.out_features * i // n for i in range(n + 1)]
        self.shards = n
        for i in range(n):
            lo, hi = bounds[i], bounds[i + 1]
            # widened to fp32 one shard at a time: the transient copy is a shard, not the matrix
            self.register_buffer(f"packed{i}", torch.fbgemm_pack_gemm_matrix_fp16(w[lo:hi].float().contiguous()),
                                 persistent=False)
            self.register_buffer(f"bias{i}", b[lo:hi].contiguous(), persistent=False)
        self._parts = [(getattr(self, f"packed{i}"), getattr(self, f"bias{i}")) for i in range(n)]
        self.inline = False  # True: run the shards one after another on the calling thread (timing)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether every weight is within fp16 range (packing would overflow otherwise)."""
        return bool(weight.detach().abs().max().item() <= FP16_MAX)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, in]`` -> ``[T, out]``."""
        x32 = x.float()
        fn = lambda part: _fp16_gemm(x32, *part)
        ys = [fn(p) for p in self._parts] if self.inline else _on_threads(fn, self._parts)
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y.to(self.out_dtype or x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp16 packed, "
                f"shards={self.shards}")


class PackedFp16MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` over packed fp16 weights, sharded across threads.

    Built from the fused ``gate_up`` weight ``[2I, H]`` (gate rows first) and ``down`` ``[H, I]``.
    Shard ``s`` owns intermediate features ``[lo_s, hi_s)``: it computes its gate and up rows, the
    activation (in the activation dtype, as the unsharded model rounds it) and its partial down
    projection over those columns in fp32; the partials are summed, then rounded once. Invariant:
    the shards' feature ranges tile ``[0, I)`` in order.
    """

    zeros_gu: torch.Tensor
    zeros_h: torch.Tensor

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, shards: int | None = None) -> None:
        super().__init__()
        inter = down.shape[1]
        if gate_up.shape != (2 * inter, down.shape[0]):
            raise ValueError(f"gate_up {tuple(gate_up.shape)} does not match down {tuple(down.shape)}")
        self.hidden_size, self.intermediate_size = down.shape
        n = max(1, min(shards if shards is not None else torch.get_num_threads(), inter))
        bounds = [inter * i // n for i in range(n + 1)]
        gu, dn = gate_up.detach().float(), down.detach().float()
        self.shards = n
        for i in range(n):
            lo, hi = bounds[i], bounds[i + 1]
            rows = torch.cat([gu[lo:hi], gu[inter + lo:inter + hi]])              # [2w, H]: gate, up
            self.register_buffer(f"gate_up{i}", torch.fbgemm_pack_gemm_matrix_fp16(rows), persistent=False)
            self.register_buffer(f"down{i}", torch.fbgemm_pack_gemm_matrix_fp16(dn[:, lo:hi].contiguous()),
                                 persistent=False)
        self.register_buffer("zeros_gu", torch.zeros(2 * max(hi - lo for lo, hi in itertools.pairwise(bounds))),
                             persistent=False)
        self.register_buffer("zeros_h", torch.zeros(self.hidden_size), persistent=False)
        self._parts = [(getattr(self, f"gate_up{i}"), getattr(self, f"down{i}"), bounds[i + 1] - bounds[i])
                       for i in range(n)]
        self.inline = False  # True: run the shards one after another on the calling thread (timing)

    @staticmethod
    def fits(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
        return PackedFp16Linear.fits(gate_up) and PackedFp16Linear.fits(down)

    def _shard(self, x32: torch.Tensor, dtype: torch.dtype, part: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
        gate_up, down, width = part
        gu = _fp16_gemm(x32, gate_up, self.zeros_gu[: 2 * width])            # [T, 2w] fp32
        act = fused.silu_mul(gu, width, dtype)                               # rounded to dtype as before, fp32
        return _fp16_gemm(act, down, self.zeros_h)                           # [T, H] fp32 partial

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]`` in x's dtype."""
        x32 = x.float()
        fn = lambda part: self._shard(x32, x.dtype, part)
        partials = [fn(p) for p in self._parts] if self.inline else _on_threads(fn, self._parts)
        y = partials[0]
        for partial in partials[1:]:
            y += partial
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, fp16 packed, shards={self.shards}"


def pack_linears(model: nn.Module) -> int:
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
