"""Device choice, CPU threads, and the KV budget the engine allocates.

The budget is ``kv_cache_memory`` bytes when given; otherwise ``kv_cache_fraction`` of the
memory free on the device after the weights are loaded (host memory available on CPU). The
count of blocks comes from :func:`kvserve.kv.layout.capacity_for_budget`, the same function the
planner uses, so ``kvserve plan --kv-cache-memory X`` predicts exactly what the engine takes.
"""

from __future__ import annotations

import logging

import psutil
import torch

from kvserve.config import CacheConfig, ModelConfig
from kvserve.kv.layout import KVCapacity, capacity_for_budget, model_kv_bytes_per_token

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
    return n


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def kv_capacity(model: ModelConfig, cache: CacheConfig, kv_dtype: str, max_model_len: int,
                device: torch.device) -> KVCapacity:
    """What the engine allocates for its KV pool."""
    bpt = model_kv_bytes_per_token(model, kv_dtype)
    if cache.num_blocks_override is not None:
        budget = cache.num_blocks_override * cache.block_size * bpt
    elif cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    else:
        budget = int(free_memory_bytes(device) * cache.kv_cache_fraction)
    return capacity_for_budget(budget, bpt, cache.block_size, max_model_len)
