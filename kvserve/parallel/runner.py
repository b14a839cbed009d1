"""The engine's side of tensor parallelism: T worker processes behind the process runner's calls.

::

    parent (engine thread)            rank 0 (process runner child loop)      ranks 1..T-1
      step record ──── pipe ────────►  shard forward ◄── all-reduce ──►  shard forward
               └────── pipe (+ trims) ─────────────────────────────────►  (follower_main)
      RunnerOutput ◄── pipe ───────── samples

The parent sends each record to every rank itself (one pipe write per rank, tens of
microseconds) rather than having rank 0 broadcast it over gloo (a 16 KiB gloo broadcast costs
~0.3 ms on this machine); rank 0 alone answers. The torch.distributed group (gloo on CPU, nccl on
CUDA) meets in a file store under a fresh temporary folder, so no TCP port is picked for it.

Failures: every ``poll_s`` while waiting, the parent checks that every rank is alive and that no
follower reported an error; any failure kills every rank (the group is out of step) and raises
:class:`~kvserve.runner.process_runner.RunnerProcessError` naming the rank. Nobody waits for a
collective's timeout.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import tempfile
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import msgspec

from kvserve.contract import RunnerOutput, SchedulerOutput, wire
from kvserve.native.choices import KernelChoice, record
from kvserve.parallel.worker import follower_main
from kvserve.runner.process_runner import ProcessRunner, RunnerProcessError, RunnerSpec, _child_main, spawn

_ENCODER = msgspec.msgpack.Encoder()


class TensorParallelRunner(ProcessRunner):
    """``spec.tensor_parallel_size`` worker processes; ``kv_bytes`` is one worker's KV pool
    (``worker_kv_bytes`` lists every rank's, all equal). ``worker_kernel_choices[r]``: the kernels
    rank r runs (rank 0's are also recorded in this process, for ``/metrics``)."""

    def __init__(self, spec: RunnerSpec, poll_s: float = 0.5) -> None:
        self.poll_s = poll_s
        self._store = tempfile.mkdtemp(prefix="kvserve-tp-")
        specs = [dataclasses.replace(spec, rank=r, dist_init=f"file://{self._store}/store")
                 for r in range(spec.tensor_parallel_size)]
        self._started = False
        self._trims: dict[str, int] = {}
        self._conn, self._proc = spawn(_child_main, specs[0], "kvserve-tp-0")
        self._peers: list[tuple[Connection, BaseProcess]] = [
            spawn(follower_main, s, f"kvserve-tp-{s.rank}") for s in specs[1:]]
        try:
            self.kv_bytes, self._snapshot, kernel_choices = pickle.loads(self._receive(b"R"))
            for choice in kernel_choices:  # rank 0's kernel choices, for this process's /metrics
                record(choice)
            self.worker_kernel_choices: list[list[KernelChoice]] = [list(kernel_choices)]
            self.worker_kv_bytes = [self.kv_bytes]
            for r in range(1, len(specs)):
                kv_bytes, ranks_choices = self._peer_started(r)
                self.worker_kv_bytes.append(kv_bytes)
                self.worker_kernel_choices.append(ranks_choices)
        except BaseException:
            self._kill_all()
            shutil.rmtree(self._store, ignore_errors=True)
            raise
        self._started = True

    @property
    def pids(self) -> list[int | None]:
        return [self._proc.pid] + [p.pid for _, p in self._peers]

    def _peer_started(self, rank: int) -> tuple[int, list[KernelChoice]]:
        conn, _ = self._peers[rank - 1]
        while not conn.poll(self.poll_s):
            self._watch()
        kv_bytes, kernel_choices = self._peer_reply(rank, b"R")  # type: ignore[misc]
        return int(kv_bytes), list(kernel_choices)

    def _peer_reply(self, rank: int, want: bytes) -> object:
        conn, proc = self._peers[rank - 1]
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            proc.join(1.0)
            raise RunnerProcessError(f"tensor-parallel rank {rank} died (exit code {proc.exitcode})") from None
        if msg[:1] != want:
            text = pickle.loads(msg[1:]) if msg[:1] == b"X" else f"unexpected reply {msg[:1]!r}"
            raise RunnerProcessError(str(text))
        return pickle.loads(msg[1:])

    def _watch(self) -> None:
        try:
            super()._watch()
            for rank, (conn, proc) in enumerate(self._peers, 1):
                if self._started and conn.poll(0):  # a follower only speaks to report a failure
                    self._peer_reply(rank, b"")
                if not proc.is_alive():
                    if conn.poll(0):
                        self._peer_reply(rank, b"")
                    proc.join(1.0)
                    raise RunnerProcessError(f"tensor-parallel rank {rank} died (exit code {proc.exitcode})")
        except RunnerProcessError:
            self._kill_all()
            raise

    def _receive(self, want: bytes) -> bytes:
        try:
            return super()._receive(want)
        except RunnerProcessError as exc:  # an error on rank 0 leaves the followers out of step
            dead = self._dead_peer()  # rank 0's error is often only the echo of a peer's death
            self._kill_all()
            if dead is None:
                raise
            raise RunnerProcessError(f"{dead} (rank 0: {str(exc)[:200]})") from None

    def _dead_peer(self, grace_s: float = 1.0) -> str | None:
        for rank, (_, proc) in enumerate(self._peers, 1):
            proc.join(grace_s)
            if not proc.is_alive():
                return f"tensor-parallel rank {rank} died (exit code {proc.exitcode})"
        return None

    def _call(self, tag: bytes, out: SchedulerOutput, want: bytes) -> bytes:
        self._watch()
        body = wire.encode(out)
        fan = tag + _ENCODER.encode((self._trims, body))
        for conn, _ in self._peers:
            self._send(conn, fan)
        self._send(self._conn, tag + body)
        return self._receive(want)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        result = super().execute(out)
        # where rank 0 cut each verified request's tokens (ModelRunner._run): the followers cut there too
        self._trims = {c.request_id: c.end - c.num_sample + len(result.sampled[c.request_id].token_ids)
                       for c in out.chunks if c.num_sample > 1 and c.request_id in result.sampled}
        return result

    def _kill_all(self) -> None:
        for proc in (self._proc, *(p for _, p in self._peers)):
            if proc.is_alive():
                proc.kill()
            proc.join(1.0)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask every rank to quit; kill those that do not within ``timeout_s``."""
        for conn, proc in self._peers:
            if proc.is_alive():
                try:
                    conn.send_bytes(b"Q")
                except OSError:
                    pass
        super().shutdown(timeout_s)
        for conn, proc in self._peers:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()
        shutil.rmtree(self._store, ignore_errors=True)
