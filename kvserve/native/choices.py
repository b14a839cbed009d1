"""The process-wide record of which kernel each role runs on this machine, and why.

Whoever picks a kernel (the GEMM path per row-count band, the attention backend, a fused op)
calls :func:`record` once with what it measured; ``/metrics``, the start-up log and
``kvserve plan --hardware cpu`` read :func:`choices`. Plain data only.

Invariant: one entry per ``(role, band)``; a later record for the same key replaces the earlier.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelChoice:
    role: str                      # e.g. "gemm", "attention_decode", "rmsnorm"
    band: str                      # e.g. "rows<=1", "rows<=16", "rows<=64", "rows<=128", "rows>128", "all"
    choice: str                    # e.g. "fbgemm_fp16", "onednn_bf16", "native_paged"
    timings_us: dict[str, float] = field(default_factory=dict)  # candidate -> median us measured
    source: str = "measured"       # "measured", "cached", "fallback", "forced"


_lock = threading.Lock()
_choices: dict[tuple[str, str], KernelChoice] = {}


def record(choice: KernelChoice) -> None:
    with _lock:
        _choices[(choice.role, choice.band)] = choice


def choices() -> list[KernelChoice]:
    """Every recorded choice, sorted by role then band."""
    with _lock:
        return [_choices[k] for k in sorted(_choices)]


def clear() -> None:
    """Forget every choice (tests)."""
    with _lock:
        _choices.clear()
