"""One OpenMP team per process: which thread owns torch's intra-op threads.

libgomp gives every thread that opens a parallel region a team (a pool of workers) of its own,
kept until that thread exits. Once the process holds more OpenMP threads than there are CPUs,
libgomp throttles the spin-wait of *every* team (``GOMP_SPINCOUNT`` drops 300x), so each parallel
region wakes its workers through the kernel instead of finding them spinning. A decode step opens
~150 regions. Measured on the 2-core Zen 4 EPYC (``python benchmarks/omp_teams.py``): decoding the
0.5B shape on a thread other than the one that loaded the model took 1.16x the time of decoding on
the loading thread, which is what the server did (it loads on the main thread and steps on
``kvserve-engine``); and after a helper thread ran one parallel op (as FBGEMM's shard threads did
during GEMM timing), the tiled kernel's one-row GEMV took 2.15x its time, to the end of the process.

Two remedies, both no-ops where the runtime is not libgomp (it is the one torch's wheels load):

* :func:`single_thread_here` for helper threads that run small torch ops (FBGEMM's shard pool, the
  KV tier loader): their regions run on the calling thread alone and never get a team;
* :func:`release_team` on a thread that is done with parallel work (the loading thread, before
  the engine thread takes over): its team's workers exit (``omp_pause_resource_all``).

Invariant: neither changes the number of threads any other thread's regions use.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger("kvserve.native")
_PAUSE_SOFT = 1  # omp_pause_soft


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """torch's libgomp (already loaded: same soname), or None with another OpenMP runtime."""
    try:
        lib = ctypes.CDLL("libgomp.so.1")
        lib.omp_set_num_threads, lib.omp_get_max_threads  # noqa: B018 - both must exist
    except (OSError, AttributeError):
        return None
    return lib


def single_thread_here() -> None:
    """This thread's parallel regions run on it alone (a pool thread's initializer).

    ``omp_set_num_threads`` sets the calling thread's own ICV; it comes after
    ``torch.get_num_threads()``, whose lazy per-thread init would otherwise set the ICV back to the
    process's thread count at this thread's first parallel op."""
    torch.get_num_threads()
    lib = _libgomp()
    if lib is not None:
        lib.omp_set_num_threads(1)


def threads_here() -> int:
    """How many threads a parallel region opened on this thread would use (torch's view)."""
    lib = _libgomp()
    return int(lib.omp_get_max_threads()) if lib is not None else torch.get_num_threads()


def release_team() -> bool:
    """Let the calling thread's OpenMP workers exit (they are re-created if it opens a region
    again). Returns whether the runtime did (False: not libgomp, or inside a region)."""
    lib = _libgomp()
    if lib is None or not hasattr(lib, "omp_pause_resource_all"):
        return False
    done = lib.omp_pause_resource_all(_PAUSE_SOFT) == 0
    log.debug("released this thread's OpenMP team: %s", done)
    return done
