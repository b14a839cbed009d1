"""Every native extension kvserve builds, and :func:`prebuild`, which builds them side by side.

Each extension is one translation unit under ``csrc/`` (plus the files it ``#include``\\ s) that
``torch.utils.cpp_extension`` compiles in ~20-35 s on a 2-core EPYC, most of it torch's headers.
Built lazily, the kernels a model's start-up uses (the tiled GEMM, the fused ops, the paged
attention) cost ~85 s there one after another, and the two a step first needs (the layer loop,
the argmax) another ~55 s inside the first request, with every other request queued behind it.
:func:`prebuild` builds all of them at model load, one thread per core (the compiler runs in a
subprocess, so the threads overlap), so the first request finds them built.

Invariants: :data:`ALL` names every ``.cpp`` file under ``csrc/`` as some extension's source
(tests/native/test_prebuild.py); an extension built here is the module every later
:func:`load` of it returns (:func:`kvserve.native.load_extension` builds a name once per process).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType

from kvserve import native

log = logging.getLogger("kvserve.native")


@dataclass(frozen=True)
class Extension:
    """One extension: its module name, the ``csrc/`` files it compiles, the ones they include."""

    name: str
    sources: tuple[str, ...]
    includes: tuple[str, ...] = ()


TILED_GEMM = Extension("kvserve_tiled_gemm", ("tiled_gemm.cpp",), ("amx_gemm.h", "amx_state.h", "transpose16.h"))
FUSED = Extension("kvserve_fused", ("fused_ops.cpp",))
PAGED = Extension("kvserve_paged", ("paged_attention.cpp",),
                  ("paged_int8.h", "transpose16.h", "amx_attention.h", "amx_state.h"))
STACK = Extension("kvserve_stack", ("decode_stack.cpp",),
                  ("tiled_gemm.cpp", "amx_gemm.h", "amx_state.h", "transpose16.h", "fused_ops.cpp",
                   "paged_attention.cpp", "paged_int8.h", "amx_attention.h"))
ARGMAX = Extension("kvserve_argmax", ("argmax.cpp",))
ALL = (STACK, PAGED, FUSED, TILED_GEMM, ARGMAX)
"""Longest build first, so that the last one to start is a short one."""


def load(ext: Extension) -> ModuleType | None:
    """``ext``'s module (built on first use, once per process), or None with
    :func:`kvserve.native.unavailable_reason` saying why."""
    return native.load_extension(ext.name, list(ext.sources), includes=list(ext.includes))


def prebuild(exts: tuple[Extension, ...] = ALL, workers: int | None = None) -> dict[str, bool]:
    """Build (or load from the cache) every extension in ``exts``, ``workers`` at a time (default:
    one per CPU, at most one per extension). Returns each name's availability; never raises (a
    failed build is its fallback, as on first use). Cheap when they are loaded already."""
    todo = [e for e in exts if e.name not in native._built]
    if not todo or not native.enabled():
        return {e.name: load(e) is not None for e in exts}
    n = max(1, min(len(todo), workers or os.cpu_count() or 1))
    log.info("native kernels: loading %d (built once per CPU, torch version and source under %s; "
             "a first build takes about a minute)", len(todo), native.cache_dir() / "native")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="kvserve-build") as pool:
        done = dict(zip([e.name for e in todo], pool.map(load, todo)))
    log.info("native kernels ready in %.1f s (%d at a time)", time.perf_counter() - t0, n)
    return {e.name: (done[e.name] if e.name in done else load(e)) is not None for e in exts}
