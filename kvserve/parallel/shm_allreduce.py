"""An all-reduce over shared memory for tensor-parallel ranks on one host (CPU).

gloo's all-reduce costs about 2 ms on this machine whatever the size (its TCP transport wakes
I/O threads for every collective), and a step runs two per layer. All CPU ranks are processes
on one host, so they can instead sum through one shared mapping (a file in ``/dev/shm``)::

    header   one 128-byte line per rank: that rank's sequence number (int64), nothing else
    data     per rank, two slots of ``slot_bytes`` (double buffering, by sequence parity)

One all-reduce of a chunk (a tensor larger than a slot goes through in slot-sized chunks):

1. ``seq += 1``; copy the chunk into my slot ``seq % 2``;
2. publish: write ``seq`` into my header line;
3. wait until every rank's header line reads ``>= seq``;
4. sum every rank's slot ``seq % 2`` in rank order (0, 1, …), in the tensor's dtype, into the
   tensor. Every rank adds the same values in the same order, so every rank holds the same bits;
   for two ranks ``a + b`` rounded once, as gloo's sum (bf16: added in fp32, rounded to bf16).

Why one sequence number per rank is enough: rank r writes slot ``s % 2`` again only at ``s + 2``,
after it saw every rank publish ``s + 1``, and a rank publishes ``s + 1`` only after it finished
reading the slots of ``s``.

Ordering: step 2's store must become visible after step 1's. x86-64 keeps stores in program
order (TSO; glibc ends its non-temporal copy loops with ``sfence``) and loads in program order,
so plain stores suffice there; elsewhere :func:`usable` says no and gloo is used.

Waiting (step 3) spins, yields the core after :data:`SPIN` checks and sleeps between checks
after :data:`SLEEP_AFTER_S`, so a descheduled peer is not starved by its waiter. Every
:data:`CHECK_S` of waiting it checks that each peer process still exists (a dead or zombie peer
raises :class:`PeerGone` at once) and after ``timeout_s`` it raises: no wait is unbounded.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
import uuid
from pathlib import Path

import psutil
import torch

LINE = 128
SLOT_BYTES = 1 << 20
"""Per rank and parity: a 256-token prefill chunk of hidden 896 in fp32 fits in one (917 KB)."""
SPIN = 2000
SLEEP_AFTER_S = 0.01
CHECK_S = 0.1
SHM_DIR = Path("/dev/shm")
ENV = "KVSERVE_TP_ALLREDUCE"
"""``auto`` (default: shared memory where :func:`usable`, else gloo), ``shm`` or ``gloo``."""


class PeerGone(RuntimeError):
    """A peer rank's process ended (or timed out) while this rank waited for it in an all-reduce."""


def usable() -> str | None:
    """Why this host cannot run the shared-memory all-reduce (``None``: it can)."""
    if os.environ.get(ENV, "auto") == "gloo":
        return f"{ENV}=gloo"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} does not keep stores in order (TSO); only x86-64 is supported"
    if not SHM_DIR.is_dir():
        return f"{SHM_DIR} does not exist"
    return None


def segment_bytes(world: int, slot_bytes: int = SLOT_BYTES) -> int:
    return world * LINE + world * 2 * slot_bytes


def create_segment(world: int, slot_bytes: int = SLOT_BYTES, directory: Path = SHM_DIR) -> Path:
    """A new zero-filled segment file, its space reserved (``posix_fallocate``: a full tmpfs fails
    here with ``OSError`` rather than with SIGBUS on first touch)."""
    path = directory / f"kvserve-tp-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, segment_bytes(world, slot_bytes))
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return path


class ShmAllReduce:
    """Rank ``rank`` of ``world``'s in-place sum over the segment at ``path`` (already created);
    ``pids[j]`` is rank j's process. Every rank must call it with tensors of the same shape and
    dtype in the same order (as every collective)."""

    def __init__(self, path: Path, rank: int, world: int, pids: list[int], slot_bytes: int = SLOT_BYTES,
                 timeout_s: float = 120.0) -> None:
        if slot_bytes % LINE:
            raise ValueError(f"slot_bytes must be a multiple of {LINE}, got {slot_bytes}")
        if world < 2:
            raise ValueError(f"a shared-memory all-reduce needs 2 or more ranks, got {world}")
        self.rank, self.world, self.slot_bytes, self.timeout_s = rank, world, slot_bytes, timeout_s
        self.path = path
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), segment_bytes(world, slot_bytes))
        self._flags = memoryview(self._map)[:world * LINE].cast("q")
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._stride = LINE // 8
        self._others = [j * self._stride for j in range(world) if j != rank]
        self._peers = {j: psutil.Process(pids[j]) for j in range(world) if j != rank}
        self._views: dict[tuple[int, torch.dtype, int], list[torch.Tensor]] = {}
        self.seq = 0

    def _slots(self, parity: int, dtype: torch.dtype, n: int) -> list[torch.Tensor]:
        """Every rank's slot ``parity`` as ``n`` elements of ``dtype`` (cached: decode repeats shapes)."""
        key = (parity, dtype, n)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 256:
                self._views.clear()
            nbytes = n * dtype.itemsize
            base = self.world * LINE
            views = [self._bytes[base + (2 * j + parity) * self.slot_bytes:][:nbytes].view(dtype)
                     for j in range(self.world)]
            self._views[key] = views
        return views

    def __call__(self, t: torch.Tensor) -> None:
        """Replace ``t`` by the sum of every rank's ``t`` (in place)."""
        if t.numel() == 0:
            return
        flat = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
        per = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), per):
            self._reduce(flat[start:start + per])
        if flat.data_ptr() != t.data_ptr():
            t.copy_(flat.view_as(t))

    def _reduce(self, part: torch.Tensor) -> None:
        self.seq += 1
        slots = self._slots(self.seq & 1, part.dtype, part.numel())
        slots[self.rank].copy_(part)
        self._flags[self.rank * self._stride] = self.seq  # publish (after the copy: x86 store order)
        self._wait(self.seq)
        torch.add(slots[0], slots[1], out=part)
        for s in slots[2:]:
            part.add_(s)

    def _wait(self, seq: int) -> None:
        flags, others = self._flags, self._others
        for _ in range(SPIN):
            if all(flags[i] >= seq for i in others):
                return
        t0 = time.monotonic()
        checked = t0
        while not all(flags[i] >= seq for i in others):
            now = time.monotonic()
            if now - t0 > SLEEP_AFTER_S:
                time.sleep(50e-6)
            else:
                os.sched_yield()
            if now - checked > CHECK_S:
                checked = now
                self._check_peers(seq, now - t0)

    def _check_peers(self, seq: int, waited_s: float) -> None:
        for j, proc in self._peers.items():
            if self._flags[j * self._stride] >= seq:
                continue
            try:
                gone = not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                raise PeerGone(f"tensor-parallel rank {j} (pid {proc.pid}) is gone; rank {self.rank} "
                               f"waited in all-reduce {seq}")
        if waited_s > self.timeout_s:
            raise PeerGone(f"all-reduce {seq}: rank {self.rank} waited {waited_s:.0f} s for its peers")


def join(rank: int, world: int, timeout_s: float = 120.0,
         slot_bytes: int = SLOT_BYTES) -> tuple[ShmAllReduce | None, str]:
    """Collective over the (gloo) default group: every rank gets a :class:`ShmAllReduce` on one
    new segment, or every rank gets ``None`` and the reason (then they all use gloo). The segment
    file is unlinked once every rank mapped it (before any rank returns), so nothing is left in
    ``/dev/shm`` however the ranks end."""
    import torch.distributed as dist

    why = usable()  # the same on every rank: one host, one environment
    if why is not None:
        if os.environ.get(ENV) == "shm":
            raise RuntimeError(f"{ENV}=shm but the shared-memory all-reduce cannot run here: {why}")
        return None, why
    pids: list[object] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    box: list[object] = [None, ""]
    if rank == 0:
        try:
            box[0] = str(create_segment(world, slot_bytes))
        except OSError as e:
            box[1] = f"cannot create a segment in {SHM_DIR}: {e}"
    dist.broadcast_object_list(box, src=0)
    reducer, err = None, str(box[1])
    try:
        if box[0] is not None:
            try:
                reducer = ShmAllReduce(Path(str(box[0])), rank, world, [int(str(p)) for p in pids],
                                       slot_bytes, timeout_s)
            except Exception as e:  # noqa: BLE001 - every rank must reach the gather below
                err = f"rank {rank} cannot map {box[0]}: {e}"
        errors: list[object] = [None] * world
        dist.all_gather_object(errors, err)
    finally:
        if rank == 0 and box[0] is not None:
            Path(str(box[0])).unlink(missing_ok=True)
    dist.barrier()  # the file is gone on every rank's return
    reasons = sorted({str(e) for e in errors if e})
    if reasons:
        if os.environ.get(ENV) == "shm":
            raise RuntimeError(f"{ENV}=shm but the shared-memory all-reduce failed: {'; '.join(reasons)}")
        return None, "; ".join(reasons)
    return reducer, ""
