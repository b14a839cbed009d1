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
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvserve.config import CacheConfig
from kvserve.contract import RunnerOutput, SchedulerOutput, wire
from kvserve.kv.layout import KVCapacity
from kvserve.kv.tiers.stack import TierStack
from kvserve.native.choices import choices, record


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

    device = torch.device(spec.device)
    if device.type == "cpu":
        set_cpu_threads(spec.num_threads)
    model, model_config = load_model(spec.model, dtype=spec.dtype, device=device)
    return ModelRunner(model, model_config, spec.capacity, spec.kv_dtype, device, seed=spec.seed, cache=spec.cache,
                       tokenizer_path=spec.model, tiers=build_tiers(spec) if spec.cache.tiers else None,
                       attention_backend=spec.attention_backend)


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


class RunnerProcessError(RuntimeError):
    """The runner process failed in a way no single request explains, or died."""


class ProcessRunner:
    """Same calls as :class:`~kvserve.runner.model_runner.ModelRunner` (``execute``, ``score``,
    ``kv_bytes``, ``shutdown``), served by a child process."""

    def __init__(self, spec: RunnerSpec, poll_s: float = 0.5) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(child, spec), name="kvserve-runner", daemon=True)
        self._proc.start()
        child.close()
        self.poll_s = poll_s
        self.kv_bytes, self._snapshot, kernel_choices = pickle.loads(self._receive(b"R"))
        for choice in kernel_choices:  # the runner process's kernel choices, for this process's /metrics
            record(choice)

    def tier_snapshot(self) -> dict[str, list[tuple[bytes, int]]]:
        """What each local tier held when the child started (its index, rebuilt from disk)."""
        return self._snapshot

    def _receive(self, want: bytes) -> bytes:
        while not self._conn.poll(self.poll_s):
            if not self._proc.is_alive():
                raise self._died()
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

    def _died(self) -> RunnerProcessError:
        self._proc.join(1.0)
        return RunnerProcessError(f"the runner process died (exit code {self._proc.exitcode})")

    def _call(self, tag: bytes, out: SchedulerOutput, want: bytes) -> bytes:
        if not self._proc.is_alive():
            raise self._died()
        try:
            self._conn.send_bytes(tag + wire.encode(out))
        except OSError:
            raise self._died() from None
        return self._receive(want)

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
