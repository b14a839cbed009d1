"""CPU buffers on transparent huge pages, for what a decode step streams: weights and the KV pool.

A one-row GEMV reads every weight once a step; with 4 KiB pages that is a TLB miss every 64 cache
lines and a page walk for every prefetch that crosses a page. With the kernel's transparent huge
pages in ``madvise`` mode (Debian's default) nothing a program allocates gets them unless it asks.
Measured on the 2-core Zen 4 EPYC (the tiled kernel's one-row GEMV on the 0.5B shape's matrices,
distinct copies past the last-level cache, the two layouts alternating): 1.01-1.08x the read
bandwidth on huge pages (``python benchmarks/huge_pages.py``). The KV pool gains more: a block's
side of one KV head on the 0.5B shape is 2 KiB and a sequence's blocks are scattered, so with
4 KiB pages nearly every block the attention kernel reads (and prefetches) is a new page and a TLB
miss; on huge pages the kernel took 0.82-0.96x the time at 16-64 sequences x 2,048 (session 18,
``python benchmarks/paged_kernel.py --pool-pages``). ``KVStorage`` allocates its pool with
:func:`empty_on`.

:func:`empty` returns a tensor over an anonymous mapping whose 2 MiB-aligned interior is
``madvise(MADV_HUGEPAGE)``; the last partial 2 MiB stays on small pages, so no page holds more than
the tensor needs (the mapping's alignment slack is never touched, so never resident). The mapping
is unmapped when the last tensor viewing it goes. Buffers under :data:`MIN_BYTES`, a kernel with
THP ``never`` (or no THP at all), and ``KVSERVE_HUGE_PAGES=0`` get a plain ``torch.empty``.

Invariant: :func:`empty` returns an uninitialised contiguous CPU tensor of the shape and dtype
asked, whichever memory backs it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
from pathlib import Path

import torch

log = logging.getLogger("kvserve.memory")
HUGE_PAGE = 2 << 20
MIN_BYTES = HUGE_PAGE
"""Smaller buffers gain nothing (not one whole huge page fits)."""
_MADV_HUGEPAGE = 14
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = _THP) -> str:
    """The kernel's THP mode: ``always``, ``madvise``, ``never`` (or ``none`` without THP)."""
    try:
        text = path.read_text()
    except OSError:
        return "none"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else "none"


def enabled() -> bool:
    """Whether :func:`empty` asks for huge pages (THP available and not switched off)."""
    if os.environ.get("KVSERVE_HUGE_PAGES", "1").lower() in ("0", "false", "no", "off"):
        return False
    return thp_mode() in ("always", "madvise") and _madvise() is not None


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor, its 2 MiB-aligned interior on huge pages where it may be."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    if nbytes < MIN_BYTES or not enabled():
        return torch.empty(shape, dtype=dtype)
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe = ctypes.c_char.from_buffer(m)  # an export while the address is read
    addr = ctypes.addressof(probe)
    del probe
    start = -addr % HUGE_PAGE
    interior = nbytes // HUGE_PAGE * HUGE_PAGE
    if _madvise()(addr + start, interior, _MADV_HUGEPAGE) != 0:  # type: ignore[misc]
        log.debug("madvise(MADV_HUGEPAGE) failed (errno %d); small pages", ctypes.get_errno())
    # the tensor holds the mapping object: unmapped when the last view of it goes
    return torch.frombuffer(m, dtype=dtype, count=numel, offset=start).view(shape)


def empty_on(device: torch.device, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """:func:`empty` on the CPU; on any other device a plain ``torch.empty`` there."""
    return empty(shape, dtype) if device.type == "cpu" else torch.empty(shape, dtype=dtype, device=device)


def resident_huge_bytes() -> int:
    """Bytes of this process's anonymous memory on huge pages now (``AnonHugePages``; 0 unknown)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
