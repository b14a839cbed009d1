"""One OpenMP team per process (kvserve/native/omp.py): helper threads never get a team of their own,
and a thread that is done with parallel work can let its team go.

The checks count the process's OS threads (``/proc/self/task``): a thread that opens a parallel
region with 2 threads gets one libgomp worker; a pinned one gets none. Each has its negative
control (an unpinned thread does get a worker), so a runtime that made no teams would fail them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvserve.native import omp

pytestmark = pytest.mark.skipif(omp._libgomp() is None or not os.path.isdir("/proc/self/task"),
                                reason="needs libgomp and /proc")


def os_threads() -> int:
    """The process's OS threads once the count holds still (threads of earlier tests' helpers, and
    their OpenMP workers, exit asynchronously)."""
    last, same, deadline = -1, 0, time.monotonic() + 5
    while same < 3 and time.monotonic() < deadline:
        n = len(os.listdir("/proc/self/task"))
        same, last = (same + 1, n) if n == last else (0, n)
        time.sleep(0.02)
    return last


def parallel_op() -> None:
    """A torch op that opens a parallel region on 2 threads (a large elementwise add)."""
    a = torch.ones(1 << 22)
    a.add_(1.0)


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def workers_made_by(setup: Callable[[], None]) -> tuple[int, int]:
    """OS threads a helper thread adds while alive after ``setup()`` then a parallel op (the
    helper itself counted), and the threads its regions would use."""
    done, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def helper() -> None:
        setup()
        parallel_op()
        seen.append(omp.threads_here())
        done.set()
        release.wait()

    before = os_threads()
    t = threading.Thread(target=helper)
    t.start()
    done.wait()
    added = os_threads() - before
    release.set()
    t.join()
    return added, seen[0]


def test_a_pinned_thread_opens_no_team() -> None:
    added, threads = workers_made_by(omp.single_thread_here)
    assert threads == 1
    assert added == 1  # the helper alone
    added, threads = workers_made_by(lambda: None)  # negative control: a plain thread gets a worker
    assert threads == 2
    assert added == 2


def test_pinning_leaves_other_threads_alone() -> None:
    workers_made_by(omp.single_thread_here)
    assert omp.threads_here() == 2
    assert torch.get_num_threads() == 2


def test_release_team_lets_the_workers_go() -> None:
    parallel_op()  # this thread has its team
    with_team = os_threads()
    assert omp.release_team()
    deadline = time.monotonic() + 5
    while os_threads() >= with_team and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os_threads() == with_team - 1
    parallel_op()  # and gets one again when it needs it
    assert os_threads() == with_team
    assert omp.threads_here() == 2


def test_gemm_shard_pool_and_tier_loader_threads_are_pinned() -> None:
    from kvserve.model.cpu_gemm import _gemm_pool, fbgemm_fp16_available
    from kvserve.runner.tier_loader import TierLoader

    if fbgemm_fp16_available():
        assert _gemm_pool(1).submit(lambda: (parallel_op(), omp.threads_here())[1]).result() == 1
    loader = TierLoader(tiers=None)  # type: ignore[arg-type]
    assert loader._pool.submit(lambda: (parallel_op(), omp.threads_here())[1]).result() == 1


def test_async_engine_start_releases_the_callers_team(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve import LLM
    from kvserve.engine import async_engine

    calls: list[str] = []
    monkeypatch.setattr(async_engine, "release_team", lambda: calls.append(threading.current_thread().name))
    ae = async_engine.AsyncLLMEngine(LLM(None, kv_cache_memory="64MiB").engine, idle_tick_s=0.05)
    try:
        ae.start()
        assert calls == [threading.current_thread().name]
        ae.start()  # already running: nothing again
        assert len(calls) == 1
    finally:
        ae.shutdown()
