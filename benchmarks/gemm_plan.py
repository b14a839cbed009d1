"""The GEMM path the start-up measurement picks per role and row band on this machine, with the
timings behind it and how long measuring took.

    python benchmarks/gemm_plan.py                 # the Qwen2.5-0.5B shape, bf16, 2 threads
    python benchmarks/gemm_plan.py --threads 1 --dtype float16

Always measures again (``KVSERVE_RETUNE_KERNELS=1``) and so refreshes this machine's cache entry.
Prints a table and writes JSON (default ``benchmarks/results/gemm_plan.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from kvserve.bench.machine import cpu_info
from kvserve.model.gemm_paths import BANDS
from kvserve.model.gemm_plan import plan_for
from kvserve.model.gemm_tune import role_shapes

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qwen2.5-0.5b": (896, 4864, 896, 128, 151936, 24)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "gemm_plan.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["KVSERVE_RETUNE_KERNELS"] = "1"
    info = cpu_info()
    print(f"CPU: {info['model']}  flags: {' '.join(info['flags'])}  threads: {args.threads}  torch {torch.__version__}")
    t0 = time.perf_counter()
    plan = plan_for(role_shapes(*SHAPES[args.shape]), getattr(torch, args.dtype))
    took = time.perf_counter() - t0
    print(f"measured in {took:.2f} s; extra weight copies kept: {plan.extra_bytes / 2**20:.0f} MiB\n")
    paths = sorted({p for bands in plan.timings_us.values() for b in bands for p in b})
    print(f"{'role':>8} {'band':>9} " + " ".join(f"{p + ' us':>20}" for p in paths) + f" {'choice':>16}")
    for role, bands in plan.timings_us.items():
        for b, band in enumerate(BANDS):
            cells = " ".join(f"{bands[b].get(p, float('nan')):>20.0f}" for p in paths)
            print(f"{role:>8} {band:>9} {cells} {plan.paths[role][b]:>16}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": info, "torch": torch.__version__, "threads": args.threads,
                                           "dtype": args.dtype, "shape": args.shape, "seconds": took,
                                           "paths": plan.paths, "timings_us": plan.timings_us,
                                           "extra_bytes": plan.extra_bytes}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
