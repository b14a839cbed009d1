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
    return {"model": model, "flags": sorted(set(flags))}
