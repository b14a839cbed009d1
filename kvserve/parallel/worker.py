"""One tensor-parallel worker process: its rank's weight shard, KV shard and step loop.

Every rank reads the same step record and runs the same block operations and the same forward
on its own heads; the layers' all-reduces keep them in lockstep. Rank 0 (:class:`LeaderRunner`)
is an ordinary :class:`~kvserve.runner.model_runner.ModelRunner` served by the process runner's
child loop: it alone computes logits and samples, and answers the parent. The other ranks
(:class:`FollowerRunner`, :func:`follower_main`) answer nothing per step; they only report a
failure, after which they stop (the group is out of step and cannot go on).

Invariant: all ranks run the same sequence of collectives. Hence no per-chunk fault isolation
under tensor parallelism (a rerun on rank 0 alone would pair its all-reduces with nothing): a
forward that raises stops the engine, like a fault no request explains.

After a verify chunk rank 0 cuts its copy of the request's tokens at the last accepted draft;
the parent sends the followers those lengths (``trims``) with the next record.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.connection import Connection

import msgspec
import psutil
import torch
import torch.distributed as dist

from kvserve.contract import RunnerOutput, ScheduledChunk, SchedulerOutput, wire
from kvserve.engine.memory import set_cpu_threads
from kvserve.model.loader import load_model_config
from kvserve.native.choices import choices
from kvserve.parallel import shm_allreduce
from kvserve.parallel.kernels import rank_gemm_plan, record_allreduce, share_attention
from kvserve.parallel.load import Reduce, load_shard
from kvserve.parallel.shard import shard_config
from kvserve.runner.block_ops import run_block_ops
from kvserve.runner.inputs import ModelInputs
from kvserve.runner.model_runner import ModelRunner
from kvserve.runner.process_runner import RunnerSpec

GROUP_TIMEOUT_S = 120.0
"""A collective that waits this long for a peer raises (the parent notices a dead peer sooner)."""

_FOLLOWER_MSG = msgspec.msgpack.Decoder(tuple[dict[str, int], bytes])


def worker_device(device: str, rank: int) -> torch.device:
    """Rank ``r`` of ``cuda:N`` runs on ``cuda:N+r``; on CPU every rank shares the host."""
    d = torch.device(device)
    return torch.device("cuda", (d.index or 0) + rank) if d.type == "cuda" else d


def worker_threads(num_threads: int | None, tp: int) -> int:
    """Threads per worker: as given, else the physical cores shared out (at least one)."""
    return num_threads or max(1, (psutil.cpu_count(logical=False) or 1) // tp)


def init_group(spec: RunnerSpec, device: torch.device) -> Reduce:
    """Join the ranks' process group (nccl on CUDA, gloo on CPU); returns the in-place sum the
    layers use: nccl's on CUDA; on CPU the shared-memory one (:mod:`~kvserve.parallel.shm_allreduce`,
    every CPU rank is on this host), or gloo's where that cannot run. Recorded as ``tp_allreduce``."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=spec.dist_init, rank=spec.rank,
                            world_size=spec.tensor_parallel_size, timeout=timedelta(seconds=GROUP_TIMEOUT_S))

    def reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t)

    if device.type == "cuda":
        record_allreduce("nccl", "default")
        return reduce
    shm, why = shm_allreduce.join(spec.rank, spec.tensor_parallel_size, GROUP_TIMEOUT_S)
    if shm is not None:
        record_allreduce("shm", "default")
        return shm
    record_allreduce("gloo", "forced" if why.startswith(shm_allreduce.ENV) else "fallback", why)
    return reduce


class _ShardedRunner(ModelRunner):
    reduce: Reduce  # the group's in-place sum (set by build_rank_runner)

    def _forward(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, ModelInputs]:
        hidden, inputs = super()._forward(chunks)
        scores = inputs.meta.block_scores  # each rank summed its own heads: add the others'
        for i in sorted(scores):
            self.reduce(scores[i])
        return hidden, inputs


class LeaderRunner(_ShardedRunner):
    """Rank 0: runs steps as a :class:`ModelRunner` does and samples; a failed batch is not rerun."""

    def _isolate(self, chunks: Sequence[ScheduledChunk], batch_error: Exception) -> RunnerOutput:
        raise batch_error


class FollowerRunner(_ShardedRunner):
    """Ranks 1..T-1: the record's block operations and forward, nothing sampled or returned."""

    @torch.inference_mode()
    def follow(self, out: SchedulerOutput, trims: dict[str, int]) -> None:
        for rid, n in trims.items():
            state = self.state.requests.get(rid)
            if state is not None:
                del state.token_ids[n:]
        self.state.apply(out)
        run_block_ops(self.storage, None, out.block_ops, RunnerOutput(out.step_id))
        if out.chunks:
            self._forward(out.chunks)


def build_rank_runner(spec: RunnerSpec) -> ModelRunner:
    """Join the group, load this rank's shard with rank 0's GEMM plan, allocate its KV shard
    (``spec.capacity``) and run rank 0's attention backend (:mod:`kvserve.parallel.kernels`)."""
    device = worker_device(spec.device, spec.rank)
    tp = spec.tensor_parallel_size
    if device.type == "cpu":
        set_cpu_threads(worker_threads(spec.num_threads, tp))
    reduce = init_group(spec, device)
    shard = shard_config(load_model_config(spec.model, spec.dtype), tp)
    plan = rank_gemm_plan(shard, spec.rank) if device.type == "cpu" else None
    model, _ = load_shard(spec.model, spec.rank, tp, reduce, spec.dtype, device, plan=plan)
    cls = LeaderRunner if spec.rank == 0 else FollowerRunner
    runner = cls(model, shard, spec.capacity, spec.kv_dtype, device, seed=spec.seed, cache=spec.cache,
                 tokenizer_path=spec.model, attention_backend=spec.attention_backend if spec.rank == 0 else "torch_sdpa")
    runner.attention = share_attention(spec.rank, runner.attention if spec.rank == 0 else None)
    runner.reduce = reduce
    return runner


def follower_main(conn: Connection, spec: RunnerSpec) -> None:
    """A follower's process: ``R`` + its KV bytes and kernel choices once started, then records until ``Q``; on any
    error ``X`` + the text, and exit."""
    try:
        runner = build_rank_runner(spec)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send_bytes(b"X" + pickle.dumps(f"tensor-parallel rank {spec.rank} failed to start: {e!r}"))
        return
    assert isinstance(runner, FollowerRunner)
    conn.send_bytes(b"R" + pickle.dumps((runner.kv_bytes, choices())))
    while True:
        try:
            msg = conn.recv_bytes()
        except EOFError:
            return
        if msg[:1] == b"Q":
            return
        try:
            trims, body = _FOLLOWER_MSG.decode(msg[1:])
            runner.follow(wire.decode(body, SchedulerOutput), trims)
        except Exception as e:  # noqa: BLE001
            conn.send_bytes(b"X" + pickle.dumps(f"tensor-parallel rank {spec.rank}: {e!r}"))
            return
