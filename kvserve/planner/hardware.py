"""The accelerator the plan is for: usable memory, bandwidth and dense throughput.

Memory is what a driver reports as usable, not the label: ``observed_memory_total_mib`` from
``nvidia-smi`` where the preset has it (an "80 GB" H100 shows 81,559 MiB), else the capacity in
GiB. ``cpu`` is this host: memory available now (psutil), and a bandwidth and matmul throughput
measured once and cached in ``~/.cache/kvserve/cpu.json`` (``KVSERVE_CACHE_DIR`` overrides).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from kvserve.planner.presets import find_hardware


@dataclass(frozen=True)
class HardwareSpec:
    """One device. ``tflops`` maps a precision (bf16, fp16, fp8, fp4) to dense TFLOPS (None: unknown)."""

    name: str
    memory_bytes: int
    memory_source: str
    bandwidth_bytes_s: float | None
    tflops: dict[str, float | None] = field(default_factory=dict)
    key: str | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"device memory must be > 0 bytes, got {self.memory_bytes}")
        if self.bandwidth_bytes_s is not None and self.bandwidth_bytes_s <= 0:
            raise ValueError(f"bandwidth must be > 0, got {self.bandwidth_bytes_s}")

    def dense_flops(self, weight_dtype: str) -> float | None:
        """Peak dense FLOP/s for matmuls at ``weight_dtype`` (fp8/int8 weights use fp8 units where
        the card has them, else bf16; int4 uses fp4 where present, else as fp8)."""
        order = {
            "fp8": ("fp8", "bf16"),
            "int8": ("fp8", "bf16"),
            "int4": ("fp4", "fp8", "bf16"),
            "float16": ("fp16", "bf16"),
            "float32": ("bf16",),
        }.get(weight_dtype, ("bf16",))
        for precision in order:
            value = self.tflops.get(precision)
            if value:
                return value * 1e12
        return None


def from_preset(name: str) -> HardwareSpec:
    """A shipped accelerator preset (aliases such as ``h100`` work); unknown names suggest neighbours."""
    key, e = find_hardware(name)
    observed = e.get("observed_memory_total_mib")
    if observed:
        memory, source = (
            int(observed) * 2**20,
            f"driver-reported {observed:,} MiB (label {e['memory_gib']} GB)",
        )
    else:
        memory, source = int(e["memory_gib"] * 2**30), f"{e['memory_gib']} GiB capacity (no driver figure)"
    tflops = {p: e.get(f"{p}_dense_tflops") for p in ("bf16", "fp16", "fp8", "fp4")}
    unverified = e.get("unverified_fields") or []
    notes = (f"{key}: unverified preset fields: {', '.join(unverified)}",) if unverified else ()
    return HardwareSpec(
        e["name"], memory, source, float(e["memory_bandwidth_gb_s"]) * 1e9, tflops, key, notes
    )


def manual(
    memory_bytes: int | None,
    bandwidth_bytes_s: float | None,
    tflops: float | None,
    base: HardwareSpec | None = None,
) -> HardwareSpec:
    """A device given by hand, or ``base`` with the given figures replaced."""
    if base is None:
        if memory_bytes is None:
            raise ValueError("--bandwidth/--tflops need --memory or --hardware to size the plan")
        base = HardwareSpec("custom", memory_bytes, "--memory", None)
    out = base
    if memory_bytes is not None:
        out = replace(out, memory_bytes=memory_bytes, memory_source="--memory")
    if bandwidth_bytes_s is not None:
        out = replace(out, bandwidth_bytes_s=bandwidth_bytes_s)
    if tflops is not None:
        out = replace(out, tflops={"bf16": tflops, "fp16": tflops})
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")


def _host_key() -> str:
    return f"{platform.node()}|{platform.machine()}|{os.cpu_count()}|{psutil.virtual_memory().total}"


def measure_bandwidth(nbytes: int = 128 * 2**20, repeats: int = 5) -> float:
    """Copy bandwidth in bytes/s (read + write counted), best of ``repeats`` numpy copies."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def measure_matmul_flops(n: int = 1024, repeats: int = 3) -> float:
    """float32 matmul FLOP/s (2·n³ per product), best of ``repeats``."""
    a = np.ones((n, n), dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def cpu_measurements(*, refresh: bool = False) -> dict[str, Any]:
    """Bandwidth and matmul throughput of this host, measured once and cached per host."""
    path = cache_dir() / "cpu.json"
    key = _host_key()
    cached: dict[str, Any] = {}
    if path.exists():
        try:
            cached = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cached = {}
    if not refresh and isinstance(cached.get(key), dict):
        entry: dict[str, Any] = cached[key]
        entry["cached"] = True
        return entry
    entry = {
        "bandwidth_bytes_s": measure_bandwidth(),
        "matmul_flops": measure_matmul_flops(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**cached, key: entry}, indent=2))
    return {**entry, "cached": False}


def this_cpu(*, refresh: bool = False) -> HardwareSpec:
    """This host: memory available now, bandwidth and FLOP/s from :func:`cpu_measurements`."""
    m = cpu_measurements(refresh=refresh)
    flops = m["matmul_flops"] / 1e12
    how = "cached" if m.get("cached") else "measured now"
    return HardwareSpec(
        f"this host ({platform.machine()}, {os.cpu_count()} CPUs)",
        int(psutil.virtual_memory().available),
        "psutil available memory",
        float(m["bandwidth_bytes_s"]),
        {"bf16": flops, "fp16": flops},
        "cpu",
        (
            (
                f"bandwidth {m['bandwidth_bytes_s'] / 1e9:.1f} GB/s and matmul {flops * 1e3:.0f} GFLOP/s, "
                f"{how} ({m['measured_at']}, under that moment's load; --remeasure to redo); "
                f"cache: {cache_dir() / 'cpu.json'}"
            ),
        ),
    )


def resolve_hardware(
    name: str | None, memory: int | None, bandwidth: float | None, tflops: float | None
) -> HardwareSpec | None:
    """``--hardware`` (preset or ``cpu``) with any ``--memory``/``--bandwidth``/``--tflops`` on top."""
    base: HardwareSpec | None = None
    if name is not None:
        base = this_cpu() if name.strip().lower() == "cpu" else from_preset(name)
    if base is None and memory is None and bandwidth is None and tflops is None:
        return None
    return manual(memory, bandwidth, tflops, base)
