"""The single ops behind the CPU choices of docs/kernels.md and docs/model-runtime.md, timed alone.

    python benchmarks/cpu_ops.py                 # Qwen2.5-0.5B shapes, bf16, 2 threads

Three tables (medians of ``--repeats``), with the CPU model and flags:

* **gemm**: the gate/up matrix ``[2 x 4864, 896]`` at 1, 4 and 16 rows on each GEMM path
  (torch's matmul, the tiled kernel, oneDNN on a reordered weight), distinct copies past 1.5x the
  last-level cache so a call streams from memory as a decode does;
* **silu_mul**: the fused SiLU·mul kernel at 1, 4 and 512 rows against its torch reference;
* **attention**: a 2,048-token prompt's causal attention (14 heads over 2 KV heads) through
  torch's causal kernel against the explicit-mask form kvserve uses for later chunks;
* **MLP rows**: the native MLP on 2,048 rows in 512-row blocks against one call;
* **turn chunk**: a session turn's 65 new tokens over 3,500 cached ones on the torch path, masked
  against split at the cache boundary and merged by log-sum-exp (what kvserve runs since session 9).

Writes JSON (default ``benchmarks/results/cpu_ops.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvserve.bench.machine import cpu_info, last_level_cache_bytes
from kvserve.model.attention import _attend, _attend_split, _causal_mask
from kvserve.model.gemm_paths import build_linear, candidate_paths
from kvserve.native import fused

ROOT = Path(__file__).resolve().parents[1]


def median_us(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def gemm_table(repeats: int) -> dict[str, dict[int, float]]:
    n, k = 2 * 4864, 896
    copies = max(2, int(1.5 * (last_level_cache_bytes() or 32 << 20)) // (n * k * 2) + 1)
    weights = [torch.full((n, k), 0.01, dtype=torch.bfloat16) for _ in range(copies)]
    out: dict[str, dict[int, float]] = {}
    for path in [p for p in candidate_paths() if p in ("native", "kvserve_tiled", "onednn_packed")]:
        mods = [build_linear(path, w, None) for w in weights]
        out[path] = {}
        for rows in (1, 4, 16):
            x = torch.randn(rows, k).bfloat16()
            out[path][rows] = median_us(lambda x=x, mods=mods: [m(x) for m in mods], repeats) / copies  # type: ignore[misc]
        del mods
    return out


def mlp_rows_table(repeats: int, rows: int = 2048) -> dict[str, float]:
    """The native MLP (torch's matmul) on a 2,048-token prompt: in 512-row blocks, as kvserve runs
    it, against one call."""
    from kvserve.model.gemm_paths import NativeMLP

    mlp = NativeMLP((torch.randn(2 * 4864, 896) * 0.02).bfloat16(), (torch.randn(896, 4864) * 0.02).bfloat16())
    x = torch.randn(rows, 896).bfloat16()
    return {"row_blocks": median_us(lambda: mlp(x), repeats), "one_call": median_us(lambda: mlp._rows(x), repeats)}


def silu_table(repeats: int) -> dict[str, dict[int, float]]:
    """The kernel itself (``fused.silu_mul`` sends more than ``fused.silu_native_rows`` rows to torch)."""
    ext = fused._ext()
    out: dict[str, dict[int, float]] = {"kernel": {}, "torch": {}}
    for rows in (1, 4, 16, 64, 128, 512):
        gu = torch.randn(rows, 2 * 4864).bfloat16()
        if ext is not None:
            out["kernel"][rows] = median_us(lambda gu=gu: ext.silu_mul(gu, 4864, 1), repeats)  # type: ignore[misc]
        out["torch"][rows] = median_us(lambda gu=gu: fused.silu_mul_reference(gu, 4864), repeats)  # type: ignore[misc]
    return out


def attention_table(repeats: int, length: int = 2048) -> dict[str, float]:
    q = torch.randn(length, 14, 64).bfloat16()
    k, v = torch.randn(2, length, 64).bfloat16(), torch.randn(2, length, 64).bfloat16()
    mask = _causal_mask(length, length, None, q.device)
    return {"causal_kernel": median_us(lambda: _attend(q, k, v, None, 0.125, causal=True), repeats),
            "explicit_mask": median_us(lambda: _attend(q, k, v, mask, 0.125), repeats)}


def split_chunk_table(repeats: int, heads: int = 8, kv_heads: int = 2, d: int = 32, q_len: int = 65,
                      ctx: int = 3500) -> dict[str, float]:
    """A session turn's chunk (``q_len`` new tokens after ``ctx`` cached ones; default: the embedded
    model at turn 37) through the torch path: the masked form, against the cascade split kvserve
    runs since session 9 (``attention._attend_split``: the cached context through torch's flash
    kernel with no mask, the chunk causally, merged by their log-sum-exps). Also the largest
    difference between the two outputs."""
    scale = d ** -0.5
    q = torch.randn(q_len, heads, d).bfloat16()
    k, v = torch.randn(kv_heads, ctx + q_len, d).bfloat16(), torch.randn(kv_heads, ctx + q_len, d).bfloat16()
    mask = _causal_mask(q_len, ctx + q_len, None, q.device)
    diff = (_attend_split(q, k, v, ctx, scale).float() - _attend(q, k, v, mask, scale).float()).abs().max().item()
    return {"masked": median_us(lambda: _attend(q, k, v, mask, scale), repeats),
            "split_lse": median_us(lambda: _attend_split(q, k, v, ctx, scale), repeats), "max_abs_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "cpu_ops.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = cpu_info()
    print(f"CPU: {info['model']}  flags: {' '.join(info['flags'])}  threads: {args.threads}  "
          f"LLC: {(last_level_cache_bytes() or 0) >> 20} MiB  torch {torch.__version__}")
    with torch.inference_mode():
        gemm, silu, attn = gemm_table(args.repeats), silu_table(args.repeats), attention_table(args.repeats)
        chunk, mlp = split_chunk_table(args.repeats), mlp_rows_table(args.repeats)
    print("\ngate/up [9728, 896] bf16, µs per call (weights past the cache)")
    print(f"{'path':>16} " + " ".join(f"{f'{r} rows':>10}" for r in (1, 4, 16)))
    for path, by_rows in gemm.items():
        print(f"{path:>16} " + " ".join(f"{by_rows[r]:>10.0f}" for r in (1, 4, 16)))
    for name, by_rows in silu.items():
        print(f"silu_mul [rows, 2 x 4864] bf16, {name}: " + ", ".join(f"{r} rows {us:.0f} µs" for r, us in by_rows.items()))
    print(f"attention, 2,048-token prompt, 14 heads / 2 KV heads, bf16, one layer: causal kernel "
          f"{attn['causal_kernel'] / 1e3:.1f} ms, explicit mask {attn['explicit_mask'] / 1e3:.1f} ms")
    print(f"native MLP, 2,048 rows: in 512-row blocks {mlp['row_blocks'] / 1e3:.1f} ms, one call "
          f"{mlp['one_call'] / 1e3:.1f} ms")
    print(f"a turn's chunk, 65 tokens after 3,500 (8 heads / 2 KV heads, d 32), one layer: masked "
          f"{chunk['masked'] / 1e3:.2f} ms, split + log-sum-exp merge {chunk['split_lse'] / 1e3:.2f} ms "
          f"(max difference {chunk['max_abs_diff']:.1e})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": info, "llc_bytes": last_level_cache_bytes(),
                                           "torch": torch.__version__, "threads": args.threads,
                                           "gemm_gate_up_us": gemm, "silu_mul_us": silu,
                                           "attention_2048_us": attn, "turn_chunk_us": chunk,
                                           "native_mlp_2048_us": mlp}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
