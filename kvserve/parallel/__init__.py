"""Tensor parallelism: one model split across T worker processes (``tensor_parallel_size``).

* :mod:`kvserve.parallel.shard`: which rows/columns of each weight a rank holds, its config;
* :mod:`kvserve.parallel.load`: a rank reads only its slices and gets its all-reduces;
* :mod:`kvserve.parallel.shm_allreduce`: the per-layer sum through shared memory (CPU, one host);
* :mod:`kvserve.parallel.kernels`: every rank runs rank 0's GEMM plan and attention backend;
* :mod:`kvserve.parallel.worker`: a rank's process (rank 0 samples, the others follow);
* :mod:`kvserve.parallel.runner`: the engine's side, the process runner's calls over T ranks.

The scheduler and KV bookkeeping do not change: every rank holds the same blocks (the same
``num_blocks``), each with ``kv_heads / T`` heads, so one block table serves all ranks.
"""

from __future__ import annotations

import dataclasses

from kvserve.config import CacheConfig, EngineConfig, ModelConfig
from kvserve.parallel.shard import shard_config


def worker_config(model: ModelConfig, config: EngineConfig, device_type: str) -> tuple[ModelConfig, CacheConfig]:
    """The model config one worker runs and the cache config its KV pool is sized from.

    ``kv_cache_memory`` (and ``num_blocks``) is per worker, as the planner's per-GPU budget is.
    Without one, on CPU the workers share the host's memory, so each takes ``kv_cache_fraction / T``
    of it. Raises ``ValueError`` (one line) for a size the model cannot be split into, or for KV
    tiers (their objects hold whole blocks, all heads; not built for tensor parallelism)."""
    tp = config.tensor_parallel_size
    shard = shard_config(model, tp)
    cache = config.cache
    if tp == 1:
        return shard, cache
    if cache.tiers:
        raise ValueError(f"tensor_parallel_size {tp} does not support KV tiers yet "
                         f"({', '.join(cache.tiers)}): drop --kv-host-memory/--kv-disk-dir/--kv-remote")
    if device_type == "cpu" and cache.kv_cache_memory is None and cache.num_blocks_override is None:
        cache = dataclasses.replace(cache, kv_cache_fraction=cache.kv_cache_fraction / tp)
    return shard, cache
