"""Which attention backend runs on this machine for this model's shape: measured once, cached.

``select_backend("auto", ...)`` times the torch path (gather + SDPA) and the native kernel on the
model's attention shape (heads, KV heads, head dim, block size, dtype) for a decode batch and
prefill chunks, on synthetic blocks, and keeps the faster per role and band: ``attention_decode`` (steps
whose sequences all decode), ``attention_prefill`` ``q<=96`` (steps whose longest chunk has at most
96 new tokens: a session's next turn over its history), ``q<=512`` (a chunk over a little history)
and ``q>512`` (a long prompt's first chunk, timed at 1,024 tokens: compute-bound, where torch's
causal flash kernel on AMX tiles ran a 2,048-token prompt's 24 layers in 1.96 s against the
kernel's 3.43 s on a 2-core AMX Xeon (session 20), while the ``q<=512`` shape had the kernel ahead). The result is cached as JSON in
:func:`kvserve.native.cache_dir` (``attention_backend.json``), keyed by CPU model and flags, torch
version, OpenMP's wait policy, the kernel's (with its headers) and the torch path's source hash and shape, so a later start reads it instead of timing
(``KVSERVE_ATTENTION_RETUNE=1`` measures again). Every choice is recorded in
:mod:`kvserve.native.choices` (``source``: measured, cached, forced or fallback), and where the
kernel is available, which of its paths the model's dtype and head_dim run on this CPU (role
``attention_native``: ``bf16_dot``, ``tiled`` or ``scalar``).

``"torch_sdpa"`` and ``"native"`` force a backend (``native`` still falls back to the torch path
where the kernel is unavailable or does not cover a case; see :mod:`kvserve.model.attention_native`).

Invariant: timing costs well under a second (small shapes, few repeats) and happens at most once
per key per machine unless asked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvserve import native
from kvserve.config import ModelConfig
from kvserve.model import attention, attention_native
from kvserve.model.attention import AttentionMetadata
from kvserve.model.attention_backends import AttentionBackend, TorchSDPABackend, get_backend
from kvserve.model.attention_native import NativePagedBackend
from kvserve.native import extensions
from kvserve.native.choices import KernelChoice, record

log = logging.getLogger("kvserve")
CHOICES = ("auto", "torch_sdpa", "native")
CACHE_FILE = "attention_backend.json"
# Shapes timed per (role, band): (sequences, context after the step, new tokens per sequence).
# Prefill is split at SHORT_CHUNK new tokens: a short chunk over a long context (a session's next
# turn) reads much context per query, where skipping the gather pays; a longer chunk is compute,
# and past LONG_CHUNK (most often a new prompt's first chunk) a GEMM-shaped flash kernel can win.
SHORT_CHUNK = 96
LONG_CHUNK = 512
SHAPES = {("attention_decode", "all"): (4, 768, 1),
          ("attention_prefill", f"q<={SHORT_CHUNK}"): (1, 1536, 64),
          ("attention_prefill", f"q<={LONG_CHUNK}"): (1, 384, 256),
          ("attention_prefill", f"q>{LONG_CHUNK}"): (1, 1024, 1024)}
ROLES = [f"{role}/{band}" for role, band in SHAPES]


def cache_key(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> str:
    from kvserve.bench.machine import cpu_info

    cpu = cpu_info()
    # Both sides' code: the kernel's source and the torch path's (a change to either retimes).
    code = b"".join((native.CSRC / f).read_bytes() for f in (*extensions.PAGED.sources, *extensions.PAGED.includes))
    code += Path(attention.__file__).read_bytes()
    src = hashlib.sha256(code).hexdigest()[:12]
    return (f"{cpu['model']}|{','.join(cpu['flags'])}|torch {torch.__version__}|kernel {src}|"
            f"omp {native.wait_policy()}|march {native.march()}|"
            f"h{heads} kvh{kv_heads} d{head_dim} bs{block_size} {str(dtype).removeprefix('torch.')}")


def _case(shape: tuple[int, int, int], heads: int, kv_heads: int, head_dim: int, block_size: int,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    seqs, ctx, new = shape
    nb = -(-ctx // block_size)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, seqs * nb, block_size, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(seqs * nb, generator=g)
    tables = [perm[i * nb:(i + 1) * nb] for i in range(seqs)]
    slots = torch.cat([t[p // block_size:p // block_size + 1] * block_size + p % block_size
                       for t in tables for p in range(ctx - new, ctx)])
    meta = AttentionMetadata(slots, [i * new for i in range(seqs + 1)], [ctx] * seqs, tables, block_size)
    q = torch.randn(seqs * new, heads, head_dim, generator=g).to(dtype)
    kv = torch.randn(seqs * new, kv_heads, head_dim, generator=g).to(dtype)
    return q, kv, cache, meta


def _time(backend: AttentionBackend, case: tuple[Any, ...], repeats: int = 7) -> float:
    q, kv, cache, meta = case
    meta.plan = backend.plan(meta, tuple(cache.shape), q.device)
    backend.forward(q, kv, kv, cache, meta, 0.125)  # warm-up
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        backend.forward(q, kv, kv, cache, meta, 0.125)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def measure(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
            timer: Callable[[AttentionBackend, tuple[Any, ...]], float] = _time) -> dict[str, dict[str, float]]:
    """Median µs per layer call of each backend, per role."""
    torch_b, native_b = TorchSDPABackend(), NativePagedBackend()
    out = {}
    for key, shape in zip(ROLES, SHAPES.values()):
        case = _case(shape, heads, kv_heads, head_dim, block_size, dtype)
        out[key] = {"torch_sdpa": timer(torch_b, case), "native": timer(native_b, case)}
    return out


def _load(path: os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def backend_for(requested: str, config: ModelConfig, block_size: int, dtype: torch.dtype,
                device: torch.device) -> AttentionBackend:
    """The backend a model runs: :func:`select_backend` for ``auto`` and the forced choices (on
    the model's attention shape), else the backend registered under ``requested``."""
    if requested not in CHOICES:
        return get_backend(requested)
    return select_backend(requested, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                          head_dim=config.head_dim, block_size=block_size, dtype=dtype, device=device)


def select_backend(requested: str, *, heads: int, kv_heads: int, head_dim: int, block_size: int,
                   dtype: torch.dtype, device: torch.device | None = None) -> AttentionBackend:
    """The backend to run (module doc); records the choice per role."""
    if requested not in CHOICES:
        raise ValueError(f"attention backend must be one of {', '.join(CHOICES)}, got {requested!r}")
    roles = ROLES
    if requested == "torch_sdpa" or (device is not None and device.type != "cpu"):
        for role in roles:
            record(KernelChoice(*role.split("/"), "torch_sdpa", source="forced" if requested == "torch_sdpa" else
                                "fallback"))
        return TorchSDPABackend()
    if attention_native.native_module() is None:
        why = attention_native.unavailable_reason()
        log.warning("native paged attention unavailable (%s); attention runs on the torch path", why)
        for role in roles:
            record(KernelChoice(*role.split("/"), "torch_sdpa", source="fallback"))
        return TorchSDPABackend() if requested == "auto" else NativePagedBackend()
    # Which of the kernel's own paths runs where it is chosen (bf16-dot, tiled, scalar): the CPU's.
    record(KernelChoice("attention_native", "all", attention_native.kernel_path(dtype, head_dim), source="default"))
    record(KernelChoice("attention_native", "int8_kv", attention_native.kernel_path(dtype, head_dim, "int8"),
                        source="default"))
    if requested == "native":
        for role in roles:
            record(KernelChoice(*role.split("/"), "native", source="forced"))
        return NativePagedBackend()
    key = cache_key(heads, kv_heads, head_dim, block_size, dtype)
    path = native.cache_dir() / CACHE_FILE
    data = _load(path)
    source = "cached"
    timings = data.get(key) if os.environ.get("KVSERVE_ATTENTION_RETUNE", "0") in ("0", "") else None
    if not isinstance(timings, dict) or set(timings) != set(roles):
        timings, source = measure(heads, kv_heads, head_dim, block_size, dtype), "measured"
        data[key] = timings
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            tmp.replace(path)
        except OSError as e:
            log.warning("cannot cache the attention backend choice in %s: %s", path, e)
    picks = {role: min(timings[role], key=timings[role].get) for role in roles}
    for role in roles:
        record(KernelChoice(*role.split("/"), picks[role], dict(timings[role]), source))  # type: ignore[misc]
    log.info("attention backend: %s (%s; µs per layer call %s)", picks, source, timings)
    if set(picks.values()) == {"torch_sdpa"}:
        return TorchSDPABackend()
    native_b = [picks[r] == "native" for r in roles]
    return NativePagedBackend(decode=native_b[0], prefill=native_b[2], short_prefill=native_b[1],
                              short_chunk=SHORT_CHUNK, long_prefill=native_b[3], long_chunk=LONG_CHUNK)
