"""Give freed heap memory back to the OS (glibc ``malloc_trim``), where the C library has it.

Loading reads each checkpoint tensor into a fresh buffer, widens weights shard by shard while
packing and frees the originals; glibc keeps such freed chunks below its mmap threshold (which
grows up to 32 MiB as large blocks are freed) in the heap for reuse, so the process's RSS stays at
its loading peak. ``malloc_trim(0)`` returns every free page. No-op elsewhere (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name)
        lib.malloc_trim  # noqa: B018 - probe: glibc only
    except (OSError, AttributeError, TypeError):
        return None
    return lib


def release_free_memory() -> bool:
    """Return the C heap's free pages to the OS; True when something was released."""
    lib = _libc()
    return bool(lib is not None and lib.malloc_trim(0))
