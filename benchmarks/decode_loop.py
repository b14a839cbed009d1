"""Decode steps of one sequence and nothing else, for a profiler to look at (``perf``), and the
machine's bf16 GEMM peak beside it.

    PYTHONPATH=$PWD perf record -F 4000 -D 9000 -o /tmp/perf.data python benchmarks/decode_loop.py --steps 500
    perf report -i /tmp/perf.data --no-children --sort dso,symbol

The model loads, a 512-token prompt is prefilled, then ``--steps`` decode steps run; ``-D`` skips
the loading in the profile. Prints ms per step and, with ``--peak``, torch's bf16 matmul rate
(GMAC/s at n x n x n: oneDNN's rate on this CPU; the instruction's own ceiling: benchmarks/dot_peak.py).
Session 16 (Zen 4 EPYC): 72 % of the samples in the tiled kernel's one-row GEMVs; peak 189-211
GMAC/s across runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from dot_peak import matmul_rate
from throughput import CACHE, ensure_model, prompt_ids

from kvserve import LLM, SamplingParams
from kvserve.bench.machine import cpu_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peak", action="store_true", help="also time torch's bf16 matmul (1,024 and 2,048)")
    args = ap.parse_args()
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {args.threads}", flush=True)
    if args.model == CACHE / "qwen2.5-0.5b":
        ensure_model(args.model, "bfloat16")
    eng = LLM(args.model, dtype="bfloat16", kv_cache_memory="1GiB", num_threads=args.threads,
              enable_prefix_caching=False).engine
    eng.add_request({"prompt_token_ids": prompt_ids(512)},
                    SamplingParams(max_tokens=args.steps + 1, temperature=0, ignore_eos=True))
    eng.step()  # the prefill
    t0, steps = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    print(f"decode: {(time.perf_counter() - t0) / max(steps, 1) * 1e3:.2f} ms per step over {steps} steps")
    if args.peak:
        for n in (1024, 2048):
            print(f"torch bf16 matmul {n}^3: {matmul_rate(n):.0f} GMAC/s")


if __name__ == "__main__":
    main()
