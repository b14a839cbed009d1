"""Native (C++) kernels, compiled on first use and cached; every caller has a pure-torch fallback.

``load_extension(name, sources)`` builds ``sources`` (files under ``kvserve/native/csrc``) with
``torch.utils.cpp_extension.load`` into a directory keyed by the CPU model and flags, the torch
version and the sources' hash, under the user cache dir (``$KVSERVE_CACHE_DIR`` or
``$XDG_CACHE_HOME/kvserve``, default ``~/.cache/kvserve``). It returns the module, or ``None``
(with the reason in :func:`unavailable_reason`) when native kernels are switched off
(``KVSERVE_NATIVE=0``), no C++ compiler or ninja exists, or the build fails.

The build targets this CPU (``-march=native``) unless ``KVSERVE_NATIVE_MARCH`` names another
target (``x86-64-v3``: AVX2 + FMA, no AVX-512; ``x86-64``: neither): a build meant for a fleet of
older CPUs, or this machine running the code paths such a CPU gets (the test suite does both).
:func:`target_features` says which instruction sets the build has, whatever the target.

Invariant: a build failure is never raised to the caller and is tried once per process.
:mod:`kvserve.native.extensions` lists every extension and builds them side by side at model load.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger("kvserve.native")
CSRC = Path(__file__).parent / "csrc"
_lock = threading.Lock()  # guards _locks
_locks: dict[str, threading.Lock] = {}  # one per extension: different names build at once
_built: dict[str, ModuleType | None] = {}
_why: dict[str, str] = {}


def cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve")
    return Path(root)


def wait_policy() -> str:
    """OpenMP's wait policy this process runs under (``OMP_WAIT_POLICY``, or ``default``): part of
    every cached timing's key, since it moves multi-threaded calls' cost by up to 2x
    (docs/kernels.md, "OpenMP's wait policy")."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() or "default"


def enabled() -> bool:
    return os.environ.get("KVSERVE_NATIVE", "1").lower() not in ("0", "false", "no", "off")


def march() -> str:
    """The ``-march`` target of native builds: ``KVSERVE_NATIVE_MARCH`` or ``native`` (this CPU).
    Part of every build's and every cached timing's key (the kernels compiled in differ).
    Raises ValueError on a value that is not a plain target name."""
    value = os.environ.get("KVSERVE_NATIVE_MARCH", "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", value):
        raise ValueError(f"KVSERVE_NATIVE_MARCH={value!r} is not a -march target name (e.g. native, x86-64-v3)")
    return value


_features: dict[str, frozenset[str]] = {}


def target_features() -> frozenset[str]:
    """The instruction-set features native builds compile in, in the compiler's own words
    (``avx2``, ``fma``, ``f16c``, ``avx512f``, ``avx512bf16``, ``avx512vnni``, ...): the
    ``__X__`` macros the compiler predefines for :func:`march`, which are what the kernels'
    ``#if`` sections test. Empty when no compiler answers."""
    target = march()
    if target not in _features:
        cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        found: set[str] = set()
        if cxx is not None:
            try:
                out = subprocess.run([cxx, f"-march={target}", "-dM", "-E", "-x", "c++", "-"], input="",
                                     capture_output=True, text=True, timeout=60, check=True).stdout
                found = {m.lower() for m in re.findall(r"#define __([A-Z0-9_]+)__ 1", out)
                         if m.startswith(("AVX", "FMA", "F16C", "AMX", "SSE"))}
            except (OSError, subprocess.SubprocessError):
                found = set()
        _features[target] = frozenset(found)
    return _features[target]


def _build_key(name: str, paths: list[Path], flags: list[str]) -> str:
    import torch

    from kvserve.bench.machine import cpu_info

    h = hashlib.sha256()
    cpu = cpu_info()
    h.update(f"{cpu['model']}|{','.join(cpu['flags'])}|{torch.__version__}|{' '.join(flags)}".encode())
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return f"{name}-{h.hexdigest()[:16]}"


def load_extension(name: str, sources: list[str], extra_cflags: list[str] | None = None,
                   includes: list[str] | None = None) -> ModuleType | None:
    """The compiled module ``name`` built from ``sources`` (names under ``csrc/``), or ``None``.
    ``includes``: files under ``csrc/`` the sources ``#include`` (staged beside them and part of the
    build key, not compiled on their own). Thread-safe: a name builds once, different names at once
    (:func:`kvserve.native.extensions.prebuild`)."""
    with _lock:
        lock = _locks.setdefault(name, threading.Lock())
    with lock:
        if name in _built:
            return _built[name]
        mod = _try_build(name, sources, extra_cflags or [], includes or [])
        _built[name] = mod
        return mod


def unavailable_reason(name: str) -> str | None:
    """Why ``name`` is not available (``None`` when it loaded or was never asked for)."""
    return _why.get(name)


def _staged(paths: list[Path], build: Path) -> list[Path]:
    """Copies of ``paths`` inside ``build/src`` (written once: the key hashes their content).
    Building from there keeps ninja's commands the same for every checkout of the repository, so
    two worktrees with the same sources share one build instead of rebuilding in turn (ninja
    rebuilds when a command's source path changes)."""
    src = build / "src"
    src.mkdir(exist_ok=True)
    staged = []
    for p in paths:
        dst = src / p.name
        data = p.read_bytes()
        if not dst.exists() or dst.read_bytes() != data:
            tmp = src / f".{p.name}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, dst)
        staged.append(dst)
    return staged


STALE_LOCK_S = 600.0  # a build takes about a minute; a lock this old was left by a killed one
LOCK_POLL_S = 1.0


def _wait_for_lock(build: Path) -> None:
    """Wait while another process holds torch's build lock, and remove it once it is stale.

    torch waits on a held lock for ever, and a killed build leaves its lock behind, so a process
    that starts while such a lock is fresh would hang (a CI run hung at test collection this way
    when a concurrent run was killed mid-build). Waiting here, before torch looks, bounds that
    wait by :data:`STALE_LOCK_S`; a live build releases the lock well within it."""
    lock = build / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_S:
            log.warning("removing a stale native build lock %s (a build was killed)", lock)
            lock.unlink(missing_ok=True)
            return
        time.sleep(LOCK_POLL_S)


def _try_build(name: str, sources: list[str], extra: list[str], includes: list[str]) -> ModuleType | None:
    if not enabled():
        _why[name] = "KVSERVE_NATIVE=0"
        return None
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        _why[name] = "no C++ compiler on PATH"
        return None
    try:
        import ninja  # noqa: F401
        from torch.utils import cpp_extension
    except ImportError as e:
        _why[name] = f"cannot build C++ extensions: {e}"
        return None
    paths = [CSRC / s for s in [*sources, *includes]]
    try:
        flags = ["-O3", f"-march={march()}", "-fopenmp", "-ffast-math", "-fno-finite-math-only", *extra]
    except ValueError as e:
        _why[name] = str(e)
        log.warning("native kernel %s unavailable (%s); using the torch fallback", name, e)
        return None
    key = _build_key(name, paths, flags)
    build = cache_dir() / "native" / key
    build.mkdir(parents=True, exist_ok=True)
    _wait_for_lock(build)
    try:
        mod = cpp_extension.load(name=name.replace("-", "_"), sources=[str(p) for p in _staged(paths, build)[:len(sources)]],
                                 extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                 build_directory=str(build), verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means "use the fallback"
        _why[name] = f"build failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("native kernel %s unavailable (%s); using the torch fallback", name, _why[name])
        return None
    log.info("native kernel %s loaded from %s (-march=%s)", name, build, march())
    record_target()
    return mod


# the instruction sets that pick a kernel path, as the kernels' #if sections name them
PATH_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bf16", "avx512vnni", "amx_bf16")


def record_target() -> None:
    """Records the build target (``native_target``, band ``all``) among the kernel choices that
    ``/metrics`` and ``kvserve plan --hardware cpu`` show: ``-march`` and the path-picking
    instruction sets it has, e.g. ``native: avx2 fma f16c avx512f avx512bf16 avx512vnni``."""
    from kvserve.native.choices import KernelChoice, record

    have = [f for f in PATH_FEATURES if f in target_features()]
    source = "forced" if os.environ.get("KVSERVE_NATIVE_MARCH", "").strip() else "default"
    record(KernelChoice("native_target", "all", f"{march()}: {' '.join(have) or 'none'}", {}, source))
