"""The one-row GEMV's read bandwidth against a plain streaming read, on the 0.5B shape's MLPs.

A decode step of one sequence reads every weight once, so its speed is the GEMV's read bandwidth.
This times, rounds interleaved (the host's memory bandwidth drifts 1.5-2x within minutes on a
shared machine, so every round has its own reference):

* ``sum``: torch summing an fp32 tensor of the same size (one sequential stream per thread: the
  bandwidth the issue's "share of the bound" is measured against, ``throughput.py``);
* ``kernel``: kvserve's tiled kernel (``kvserve/native/csrc/tiled_gemm.cpp``), one input row,
  through every layer's gate/up and down matrices (24 layers, past the last-level cache, on huge
  pages as the loader puts them);
* ``kernel@REV`` with ``--rev REV``: the kernel as it was at a git revision (built beside);
* ``torch``: ``F.linear`` on the same matrices (oneDNN).

Prints the CPU, GB/s per candidate (median over rounds, and over the *fast* rounds: those whose
``sum`` came within 15 % of the run's best, when the host's memory was least contended) and each
candidate's ratio to ``sum`` in the same round; writes JSON.

    PYTHONPATH=$PWD python benchmarks/gemv_bandwidth.py --rev HEAD
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from revision_build import build_revision

from kvserve.bench.machine import cpu_info
from kvserve.model import huge_pages, tiled_gemm

HIDDEN, INTER, LAYERS = 896, 4864, 24  # Qwen2.5-0.5B


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default=None, help="also time the kernel as it was at this git revision")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "gemv_bandwidth.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {args.threads}")
    ext = tiled_gemm._ext()
    if ext is None:
        raise SystemExit("the tiled kernel does not build here (no AVX2/FMA/F16C or no compiler)")
    gen = torch.Generator().manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return huge_pages.empty((n, k), torch.bfloat16).copy_(torch.randn(n, k, generator=gen) * 0.02)

    mats = [(weight(2 * INTER, HIDDEN), weight(HIDDEN, INTER)) for _ in range(LAYERS)]
    nbytes = sum(a.numel() * 2 + b.numel() * 2 for a, b in mats)
    ref = huge_pages.empty((nbytes // 4,), torch.float32).fill_(1.0)
    x = torch.randn(1, HIDDEN, generator=gen).bfloat16()
    h = torch.randn(1, INTER, generator=gen).bfloat16()
    none = torch.empty(0)

    def gemvs(gemm: Callable) -> Callable[[], None]:
        def run() -> None:
            for a, b in mats:
                gemm(x, a, none, 1)
                gemm(h, b, none, 1)
        return run

    cands: dict[str, Callable[[], object]] = {"sum": ref.sum, "kernel": gemvs(ext.gemm)}
    if args.rev:
        old = build_revision(args.rev, "kvserve/native/csrc/tiled_gemm.cpp")
        assert torch.equal(old.gemm(x, mats[0][0], none, 1), ext.gemm(x, mats[0][0], none, 1))
        cands[f"kernel@{args.rev}"] = gemvs(old.gemm)
    cands["torch"] = lambda: [(F.linear(x, a), F.linear(h, b)) for a, b in mats]
    gbs: dict[str, list[float]] = {k: [] for k in cands}
    for rnd in range(args.rounds + 1):
        order = list(cands) if rnd % 2 == 0 else list(cands)[::-1]
        for name in order:
            t0 = time.perf_counter()
            cands[name]()
            if rnd > 0:  # round 0 warms every candidate up
                gbs[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
    best = max(gbs["sum"])
    fast = [i for i, s in enumerate(gbs["sum"]) if s >= 0.85 * best]
    rows = {}
    print(f"\none-row GEMVs over {LAYERS} layers' MLP matrices ({nbytes / 2**20:.0f} MiB), {args.rounds} rounds; "
          f"{len(fast)} fast rounds (sum within 15 % of its best, {best:.1f} GB/s)")
    print(f"{'candidate':>16} {'GB/s':>7} {'fast GB/s':>10} {'÷ sum':>7} {'÷ sum (fast)':>13}")
    for name, v in gbs.items():
        ratio = [a / s for a, s in zip(v, gbs["sum"])]
        rows[name] = {"gbs_median": statistics.median(v), "gbs_fast_median": statistics.median([v[i] for i in fast]),
                      "ratio_to_sum_median": statistics.median(ratio),
                      "ratio_to_sum_fast_median": statistics.median([ratio[i] for i in fast]), "gbs": v}
        r = rows[name]
        print(f"{name:>16} {r['gbs_median']:>7.1f} {r['gbs_fast_median']:>10.1f} {r['ratio_to_sum_median']:>7.2f} "
              f"{r['ratio_to_sum_fast_median']:>13.2f}")
    doc = {"cpu": cpu, "threads": args.threads, "command": " ".join(["python", "benchmarks/gemv_bandwidth.py", *sys.argv[1:]]),
           "bytes": nbytes, "rounds": args.rounds, "fast_rounds": fast, "candidates": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
