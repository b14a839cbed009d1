"""Device choice, CPU threads, and the KV budget the engine allocates.

The budget is ``kv_cache_memory`` bytes when given; otherwise ``kv_cache_fraction`` of the
memory free on the device after the weights are loaded (host memory available on CPU). The
count of blocks comes from :func:`kvserve.kv.layout.capacity_for_budget`, the same function the
planner uses, so ``kvserve plan --kv-cache-memory X`` predicts exactly what the engine takes.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import psutil
import torch

from kvserve.config import CacheConfig, ModelConfig
from kvserve.kv.layout import (
    KVCapacity,
    capacity_for_budget,
    model_kv_bytes_per_token,
    window_block_bytes,
    window_blocks,
)
from kvserve.kv.press import peak_blocks
from kvserve.native import wait_policy

if TYPE_CHECKING:
    from kvserve.kv.calibration import Calibration

log = logging.getLogger("kvserve")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use device='cpu'")
    return torch.device(name)


def set_cpu_threads(num_threads: int | None) -> int:
    """Use one thread per physical core unless told otherwise (SMT siblings slow GEMV down)."""
    n = num_threads or psutil.cpu_count(logical=False) or torch.get_num_threads()
    torch.set_num_threads(n)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0  # not on Windows
    level, note = omp_wait_note(n, wait_policy(), load, os.cpu_count() or 1)
    log.log(level, note)
    return n


def omp_wait_note(threads: int, policy: str, load: float, cpus: int) -> tuple[int, str]:
    """The start-up line on OpenMP's wait policy (``policy`` as :func:`kvserve.native.wait_policy`
    names it): a warning when workers spin (libgomp's default or ACTIVE) on a host already busier
    than its cores, where PASSIVE is faster (benchmarks/omp_wait.py: with one busy process beside a
    2-core decode, spinning made steps 1.4-2.3x longer; on idle cores sleeping made them 1.6-1.9x
    longer)."""
    name = "default (spin, then sleep)" if policy == "default" else policy
    line = f"OpenMP: {threads} threads, wait policy {name}; load average {load:.1f} on {cpus} CPUs"
    if policy != "PASSIVE" and threads > 1 and load > cpus:
        return logging.WARNING, (line + ": the host is busier than its CPUs, where spinning workers slow "
                                 "every step; set OMP_WAIT_POLICY=PASSIVE before starting kvserve")
    return logging.INFO, line


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def kv_capacity(model: ModelConfig, cache: CacheConfig, kv_dtype: str, max_model_len: int,
                device: torch.device, max_num_seqs: int = 1) -> KVCapacity:
    """What the engine allocates for its KV pool: blocks at the codec's exact bytes per token, plus
    (lossy codecs) the full-precision window, both inside the budget (:mod:`kvserve.kv.layout`)."""
    bpt = model_kv_bytes_per_token(model, kv_dtype, cache.block_size, cache.kv_quant_group_size)
    w_blocks = window_blocks(kv_dtype, cache.block_size, max_num_seqs, cache.kv_quant_min_tokens,
                             cache.kv_quant_sink_tokens)
    w_bytes = window_block_bytes(model, cache.block_size)
    if cache.num_blocks_override is not None:
        budget = cache.num_blocks_override * cache.block_size * bpt + w_blocks * w_bytes
    elif cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    else:
        budget = int(free_memory_bytes(device) * cache.kv_cache_fraction)
    return capacity_for_budget(budget, bpt, cache.block_size, max_model_len, w_blocks, w_bytes, model.sliding_window)


def fit_max_model_len(max_model_len: int, capacity: KVCapacity, requested: int | None,
                      sliding_window: int | None = None, chunk_tokens: int = 1) -> int:
    """``max_model_len`` the pool can serve. A length the model's config implied is lowered to the
    pool's token capacity with a warning that names both; one the user asked for is refused (as
    vLLM does), since every request near it would fail later. A windowed model frees blocks
    behind its window, so a sequence needs only :func:`kvserve.kv.press.peak_blocks` of them
    (steps of at most ``chunk_tokens``): a pool smaller than ``max_model_len`` can serve it."""
    pool_tokens = capacity.num_blocks * capacity.block_size
    peak = peak_blocks(max_model_len, capacity.block_size, sliding_window, chunk_tokens)
    if max_model_len <= pool_tokens or peak <= capacity.num_blocks:
        return max_model_len
    if requested is not None:
        raise ValueError(f"max_model_len {max_model_len} exceeds the KV pool's {pool_tokens} tokens "
                         f"({capacity.num_blocks} blocks of {capacity.block_size}); raise kv_cache_memory "
                         f"or lower max_model_len to at most {pool_tokens}")
    log.warning("max_model_len lowered from %d (the model's) to %d, what the KV pool holds; raise "
                "kv_cache_memory to serve longer sequences", max_model_len, pool_tokens)
    return pool_tokens


def calibration_summary(cal: Calibration, capacity: KVCapacity, model: ModelConfig, cache: CacheConfig,
                        max_model_len: int, device: torch.device, max_num_seqs: int = 1) -> str:
    """The start-up lines of a calibrated per-layer map: each layer's K/V codec and the capacity it
    buys against the model dtype on every layer, for the same budget."""
    full = kv_capacity(model, cache, model.dtype, max_model_len, device, max_num_seqs)
    return (f"KV precision per layer (budget kl={cal.budget_kl:g}, joint KL {cal.joint_kl:.2e} on "
            f"{cal.text.get('tokens', '?')} held-out tokens; {cal.source}):\n{cal.describe()}\n"
            f"  {capacity.bytes_per_token} bytes/token vs {full.bytes_per_token} ({model.dtype}): "
            f"{capacity.num_blocks} blocks = {capacity.token_capacity} tokens vs {full.num_blocks} blocks = "
            f"{full.token_capacity} tokens ({capacity.token_capacity / max(full.token_capacity, 1):.2f}×)")
