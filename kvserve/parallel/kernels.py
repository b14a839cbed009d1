"""Which kernels a tensor-parallel rank runs: rank 0 chooses, as a single engine does; the others follow.

A single engine's loader takes its GEMM paths from :func:`kvserve.model.gemm_plan.plan_for` and its
runner its attention backend from :func:`kvserve.model.attention_choice.select_backend`, both keyed
by the shapes they run. A rank runs the shard's shapes (``H/T`` heads, ``KVH/T`` KV heads, ``I/T``
MLP width; the full ``vocab × hidden`` logits on rank 0), so those get their own cache entries,
measured with the rank's own thread count.

Rank 0 alone measures (or reads the cache), while the others wait in a broadcast: ranks timing at
once on shared cores would disturb each other's timings, and two writers would race on one cache
file. Then every rank runs rank 0's choice: the same GEMM path per role and band (off rank 0 the
logits role is ``native``: there is no logits projection there) and the same attention backend.
Each rank records what it runs in :mod:`kvserve.native.choices` (rank 0's go to the parent's
``/metrics``, as the process runner's do).

Invariant: every rank calls these functions in the same order (they are collectives).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from kvserve.config import ModelConfig
from kvserve.model.attention_backends import AttentionBackend, get_backend
from kvserve.model.attention_native import NativePagedBackend
from kvserve.model.gemm_plan import GemmPlan, plan_for, record_plan
from kvserve.model.gemm_tune import role_shapes
from kvserve.model.loader import torch_dtype
from kvserve.native.choices import KernelChoice, choices, record
from kvserve.parallel.load import without_logits

log = logging.getLogger("kvserve")


def _from_rank0(value: object) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank_gemm_plan(shard: ModelConfig, rank: int) -> GemmPlan:
    """The GEMM plan rank ``rank`` applies to its shard (``shard``: :func:`~kvserve.parallel.shard.shard_config`)."""
    plan: GemmPlan | None = None
    if rank == 0:
        roles = role_shapes(shard.hidden_size, shard.intermediate_size, shard.num_attention_heads * shard.head_dim,
                            shard.num_key_value_heads * shard.head_dim, shard.vocab_size, shard.num_hidden_layers)
        plan = plan_for(roles, torch_dtype(shard.dtype))  # records and logs it
    plan = _from_rank0(plan)
    assert plan is not None
    if rank != 0:
        plan = without_logits(plan)
        record_plan(plan)
    return plan


def describe(backend: AttentionBackend) -> tuple[object, ...]:
    """Plain data that rebuilds ``backend`` (:func:`rebuild`)."""
    if isinstance(backend, NativePagedBackend):
        return ("native", backend.decode, backend.prefill, backend.short_prefill, backend.short_chunk,
                backend.long_prefill, backend.long_chunk)
    return (backend.name,)


def rebuild(desc: tuple[object, ...]) -> AttentionBackend:
    if desc[0] == "native":
        _, decode, prefill, short_prefill, short_chunk, long_prefill, long_chunk = desc
        return NativePagedBackend(decode=bool(decode), prefill=bool(prefill), short_prefill=bool(short_prefill),
                                  short_chunk=int(str(short_chunk)), long_prefill=bool(long_prefill),
                                  long_chunk=int(str(long_chunk)))
    return get_backend(str(desc[0]))


def share_attention(rank: int, backend: AttentionBackend | None) -> AttentionBackend:
    """Rank 0's attention backend (``backend``, chosen by its runner), on every rank; the followers
    record rank 0's attention choices as theirs."""
    mine = None if backend is None else (describe(backend), [c for c in choices() if c.role.startswith("attention")])
    desc, picked = _from_rank0(mine)
    if rank == 0:
        assert backend is not None
        return backend
    for c in picked:
        record(c)
    return rebuild(desc)


def record_allreduce(choice: str, source: str, why: str = "") -> None:
    """The per-layer sum's implementation (``shm``, ``gloo`` or ``nccl``) as a kernel choice."""
    record(KernelChoice("tp_allreduce", "all", choice, {}, source))
    if why:
        log.warning("tensor parallel: the per-layer all-reduce runs on %s (%s)", choice, why)
