"""The model runner in a child process: the scheduler and KV bookkeeping stay in the parent.

::

    parent (engine thread)                         child (spawned)
      SchedulerOutput ── msgpack bytes over a pipe ──►  ModelRunner.execute
      RunnerOutput    ◄── msgpack bytes ────────────────┘   (model, KV storage, sampler state)

Messages are one tag byte + payload: ``E`` execute (a step record), ``S`` score (logits come back
pickled), ``Q`` quit. The child answers ``R`` + the record, ``T`` + a pickled tensor, or ``X`` + the
pickled text of an error no request explains (the parent raises it: the engine stops). A child
that dies is noticed within ``poll_s`` and reported the same way; nobody waits forever.

``spawn`` (not ``fork``): the child starts clean, without the parent's OpenMP thread pools, and
loads the weights itself, so the parent never holds them.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from kvserve.config import CacheConfig
from kvserve.contract import RunnerOutput, SchedulerOutput, wire
from kvserve.kv.layout import KVCapacity
from kvserve.kv.tiers.stack import TierStack
from kvserve.native.choices import choices, record
from kvserve.runner.draft_runner import DraftSpec


@dataclass(frozen=True)
class RunnerSpec:
    """What a runner needs to build itself anywhere: plain, picklable values only."""

    model: str
    dtype: str
    device: str
    capacity: KVCapacity
    kv_dtype: str
    cache: CacheConfig
    num_threads: int | None = None
    seed: int = 0
    root_key: bytes = b""  # the engine's block root (kvserve.kv.hashing): tier objects carry it
    attention_backend: str = "auto"  # kvserve.model.attention_choice.select_backend
    # Tensor parallel (kvserve.parallel): this worker's rank of ``tensor_parallel_size``, and the
    # torch.distributed rendezvous (a file store URL). ``capacity`` is then one worker's pool.
    tensor_parallel_size: int = 1
    rank: int = 0
    dist_init: str = ""
    draft: DraftSpec | None = None  # speculative method "draft" (kvserve.runner.draft_runner)


def build_tiers(spec: RunnerSpec) -> TierStack:
    """The configured tiers below the pool, fastest first (``CacheConfig.tiers``)."""
    from kvserve.kv.tiers.disk import DiskTier
    from kvserve.kv.tiers.host import HostTier
    from kvserve.kv.tiers.remote import RemoteTier

    c = spec.cache
    tiers: list[Any] = []
    if c.kv_host_memory is not None:
        tiers.append(HostTier(c.kv_host_memory, c.kv_tier_eviction))
    if c.kv_disk_dir is not None:
        tiers.append(DiskTier(c.kv_disk_dir, c.kv_disk_size, c.kv_tier_eviction))
    if c.kv_remote is not None:
        tiers.append(RemoteTier(c.kv_remote))
    return TierStack(tiers, spec.root_key, c.kv_tier_write)


def build_inline_runner(spec: RunnerSpec) -> Any:
    """Load the model and build a :class:`~kvserve.runner.model_runner.ModelRunner` in this process."""
    from kvserve.engine.memory import set_cpu_threads
    from kvserve.model.loader import load_model
    from kvserve.runner.model_runner import ModelRunner

    if spec.tensor_parallel_size > 1:
        from kvserve.parallel.worker import build_rank_runner

        return build_rank_runner(spec)
    device = torch.device(spec.device)
    if device.type == "cpu":
        set_cpu_threads(spec.num_threads)
    model, model_config = load_model(spec.model, dtype=spec.dtype, device=device)
    return ModelRunner(model, model_config, spec.capacity, spec.kv_dtype, device, seed=spec.seed, cache=spec.cache,
                       tokenizer_path=spec.model, tiers=build_tiers(spec) if spec.cache.tiers else None,
                       attention_backend=spec.attention_backend, root_key=spec.root_key,
                       draft=build_draft_runner(spec, model_config.vocab_size, device))


def build_draft_runner(spec: RunnerSpec, target_vocab: int, device: torch.device) -> Any:
    """The draft model and its KV rows, in the target's dtype (None without ``spec.draft``)."""
    if spec.draft is None:
        return None
    from kvserve.model.attention_choice import backend_for
    from kvserve.model.loader import load_model, torch_dtype
    from kvserve.runner.draft_runner import DraftRunner

    model, config = load_model(spec.draft.model, dtype=spec.dtype, device=device)
    attention = backend_for(spec.attention_backend, config, spec.capacity.block_size, torch_dtype(config.dtype), device)
    return DraftRunner(model, config, rows=spec.draft.rows, max_len=spec.draft.max_len,
                       block_size=spec.capacity.block_size, target_vocab=target_vocab, attention=attention,
                       device=device)


def make_runner(spec: RunnerSpec, kind: str) -> Any:
    """The engine's runner: T worker processes for ``spec.tensor_parallel_size`` T > 1 (whatever
    ``kind`` says), else a child process (``kind="process"``) or this process (``"inline"``)."""
    if spec.tensor_parallel_size > 1:
        from kvserve.parallel.runner import TensorParallelRunner

        return TensorParallelRunner(spec)
    return ProcessRunner(spec) if kind == "process" else build_inline_runner(spec)


def _child_main(conn: Connection, spec: RunnerSpec) -> None:
    try:
        runner = build_inline_runner(spec)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send_bytes(b"X" + pickle.dumps(f"runner process failed to start: {e!r}"))
        return
    conn.send_bytes(b"R" + pickle.dumps((runner.kv_bytes, runner.tier_snapshot(), choices())))
    while True:
        try:
            msg = conn.recv_bytes()
        except EOFError:
            return
        tag, body = msg[:1], msg[1:]
        if tag == b"Q":
            return
        try:
            out = wire.decode(body, SchedulerOutput)
            if tag == b"E":
                conn.send_bytes(b"R" + wire.encode(runner.execute(out)))
            else:
                conn.send_bytes(b"T" + pickle.dumps(runner.score(out)))
        except Exception as e:  # noqa: BLE001
            conn.send_bytes(b"X" + pickle.dumps(f"{e!r}"))


def spawn(target: Callable[[Connection, RunnerSpec], None], spec: RunnerSpec,
          name: str) -> tuple[Connection, BaseProcess]:
    """Start ``target(conn, spec)`` in a spawned daemon process; returns the parent's end and it."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, spec), name=name, daemon=True)
    proc.start()
    child.close()
    return conn, proc


class RunnerProcessError(RuntimeError):
    """The runner process failed in a way no single request explains, or died."""


class ProcessRunner:
    """Same calls as :class:`~kvserve.runner.model_runner.ModelRunner` (``execute``, ``score``,
    ``kv_bytes``, ``shutdown``), served by a child process."""

    def __init__(self, spec: RunnerSpec, poll_s: float = 0.5) -> None:
        self.poll_s = poll_s
        self._conn, self._proc = spawn(_child_main, spec, "kvserve-runner")
        self.kv_bytes, self._snapshot, kernel_choices = pickle.loads(self._receive(b"R"))
        for choice in kernel_choices:  # the runner process's kernel choices, for this process's /metrics
            record(choice)

    def tier_snapshot(self) -> dict[str, list[tuple[bytes, int]]]:
        """What each local tier held when the child started (its index, rebuilt from disk)."""
        return self._snapshot

    def _receive(self, want: bytes) -> bytes:
        while not self._conn.poll(self.poll_s):
            self._watch()
        try:
            msg = self._conn.recv_bytes()
        except (EOFError, OSError):
            raise self._died() from None
        tag, body = msg[:1], msg[1:]
        if tag == b"X":
            raise RunnerProcessError(pickle.loads(body))
        if tag != want:
            raise RunnerProcessError(f"unexpected reply {tag!r} from the runner process")
        return body

    def _watch(self) -> None:
        """Called every ``poll_s`` while a reply is awaited: raise if the child died."""
        if not self._proc.is_alive():
            raise self._died()

    def _died(self) -> RunnerProcessError:
        self._proc.join(1.0)
        return RunnerProcessError(f"the runner process died (exit code {self._proc.exitcode})")

    def _call(self, tag: bytes, out: SchedulerOutput, want: bytes) -> bytes:
        self._watch()
        self._send(self._conn, tag + wire.encode(out))
        return self._receive(want)

    def _send(self, conn: Connection, msg: bytes) -> None:
        try:
            conn.send_bytes(msg)
        except OSError:
            raise self._died() from None

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return wire.decode(self._call(b"E", out, b"R"), RunnerOutput)

    def score(self, out: SchedulerOutput) -> torch.Tensor:
        tensor: torch.Tensor = pickle.loads(self._call(b"S", out, b"T"))
        return tensor

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the child to quit; kill it if it does not within ``timeout_s``."""
        if self._proc.is_alive():
            try:
                self._conn.send_bytes(b"Q")
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout_s)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()
