"""The shared-memory all-reduce gives gloo's bits (bf16 and fp32, chunked, non-contiguous), leaves
nothing in /dev/shm, and a dead, zombie or silent peer is an error within seconds, never a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.parallel import shm_allreduce
from kvserve.parallel.shm_allreduce import PeerGone, ShmAllReduce, create_segment

SLOT = 1024  # bytes: the [40, 64] bf16 case goes through in 5 chunks


def _cases(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(3, 896, generator=g).to(torch.bfloat16),
            torch.randn(5, 7, generator=g),
            torch.randn(40, 64, generator=g).to(torch.bfloat16),
            torch.randn(8, 6, generator=g).t(),  # not contiguous
            torch.randn(1, generator=g)]


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    shm, why = shm_allreduce.join(rank, 2, slot_bytes=SLOT)
    assert shm is not None, why
    result = {"segment_left": shm.path.exists(), "shm": [], "gloo": []}
    for _ in range(2):  # twice: both parities of every slot, and sequence numbers carried over
        for x in _cases(rank):
            a, b = x.clone(), x.clone()
            shm(a)
            dist.all_reduce(b)
            result["shm"].append(a)
            result["gloo"].append(b)
    torch.save(result, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def test_the_sum_is_gloos_bit_for_bit_on_every_rank(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    expected = [a + b for a, b in zip(_cases(0), _cases(1))] * 2  # bf16: added in fp32, rounded once
    for got0, got1, gloo, want in zip(r0["shm"], r1["shm"], r0["gloo"], expected):
        assert got0.dtype == want.dtype and got0.shape == want.shape
        assert torch.equal(got0, gloo) and torch.equal(got0, got1) and torch.equal(got0, want)
    assert not r0["segment_left"] and not r1["segment_left"]  # unlinked once both had mapped it


@pytest.fixture
def peer() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def _reducer(tmp_path: Path, pid: int, timeout_s: float = 60.0) -> ShmAllReduce:
    path = create_segment(2, SLOT, directory=tmp_path)
    return ShmAllReduce(path, 0, 2, [os.getpid(), pid], SLOT, timeout_s)


@pytest.mark.parametrize("reaped", [False, True], ids=["zombie", "reaped"])
def test_a_dead_peer_is_an_error_within_a_second(tmp_path: Path, peer: subprocess.Popen[bytes],
                                                 reaped: bool) -> None:
    reduce = _reducer(tmp_path, peer.pid)
    peer.kill()
    if reaped:
        peer.wait()
    else:
        time.sleep(0.2)  # dead, not yet waited for: a zombie, whose pid still exists
    t0 = time.monotonic()
    with pytest.raises(PeerGone, match=rf"tensor-parallel rank 1 \(pid {peer.pid}\) is gone"):
        reduce(torch.ones(4))
    assert time.monotonic() - t0 < 1.0


def test_a_silent_peer_times_out(tmp_path: Path, peer: subprocess.Popen[bytes]) -> None:
    reduce = _reducer(tmp_path, peer.pid, timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(PeerGone, match="waited"):
        reduce(torch.ones(4))
    assert time.monotonic() - t0 < 2.0


def test_gloo_when_asked_or_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(shm_allreduce.ENV, "gloo")
    assert shm_allreduce.join(0, 2) == (None, "KVSERVE_TP_ALLREDUCE=gloo")  # no collective needed
    monkeypatch.setenv(shm_allreduce.ENV, "auto")
    monkeypatch.setattr(shm_allreduce.platform, "machine", lambda: "aarch64")
    reason = shm_allreduce.usable()
    assert reason is not None and "TSO" in reason
    monkeypatch.setenv(shm_allreduce.ENV, "shm")
    with pytest.raises(RuntimeError, match="KVSERVE_TP_ALLREDUCE=shm but"):
        shm_allreduce.join(0, 2)
