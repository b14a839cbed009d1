"""The machine a benchmark ran on: CPU model and the SIMD flags that decide kernel speed (every
benchmark prints and records them, since a kernel choice tuned on one CPU can be 3x off on the next)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_info() -> dict[str, object]:
    model, flags = platform.processor(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = [f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "f16c"))]
                break
    except OSError:
        pass
    return {"model": model, "flags": sorted(set(flags)), "native_march": _native_march()}


def _native_march() -> str:
    """The target kvserve's C++ kernels are built for (``native`` unless ``KVSERVE_NATIVE_MARCH``
    names another): a benchmark of kernels built for another CPU says so."""
    from kvserve.native import march

    try:
        return march()
    except ValueError as e:
        return f"invalid ({e})"


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The size of cpu0's highest-level data/unified cache in bytes (Linux sysfs), or None."""
    best: tuple[int, int] | None = None
    try:
        for index in root.glob("index*"):
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            size = int(text.rstrip("KMG")) * mult
            if best is None or level > best[0]:
                best = (level, size)
    except (OSError, ValueError):
        return None
    return best[1] if best else None
