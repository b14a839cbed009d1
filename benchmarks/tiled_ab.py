"""The tiled GEMM kernel of a git revision against the working tree's, inside one engine,
interleaved: decode ms per engine step at each batch size.

    python benchmarks/tiled_ab.py                          # HEAD's kernel vs the working tree's
    python benchmarks/tiled_ab.py --rev HEAD~3 --batch 1,16 --rounds 8

The revision's ``kvserve/native/csrc/tiled_gemm.cpp`` is built under another module name (its own
build directory in the native cache), and every ``kvserve_tiled`` module of one loaded engine
(:class:`~kvserve.model.tiled_gemm.TiledLinear`) is switched between the two builds' ``gemm``
round by round, the order alternating, and so is the native layer loop that decode steps of up to
64 tokens run (``kvserve/native/csrc/decode_stack.cpp``, which compiles the kernel in: the
revision's stack is built beside the working tree's and swapped with it). So both kernels see the same weights, plan, KV and
sequences, and a drift of a noisy host hits both alike (single decode steps ranged 36-80 ms in
one process on the session-9 EPYC; the host's speed drifted 1.5x within minutes in session 10).
Only the roles the plan puts on ``kvserve_tiled`` change; the table says how many modules those are.
Prints the CPU, a table and writes JSON (default ``benchmarks/results/tiled_ab.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine_ab import alternate, medians
from revision_build import build_revision
from throughput import CACHE

from kvserve import LLM
from kvserve.bench.machine import cpu_info
from kvserve.native.choices import choices

SOURCE = "kvserve/native/csrc/tiled_gemm.cpp"
STACK = "kvserve/native/csrc/decode_stack.cpp"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--rev", default="HEAD", help="the git revision whose kernel is the baseline")
    ap.add_argument("--batch", default="1,16", help="sequences decoding together, comma-separated")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="timed engine steps per round and kernel")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "tiled_ab.json")
    args = ap.parse_args()
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {args.threads}")
    from kvserve.model import decode_stack
    from kvserve.model.tiled_gemm import TiledLinear, _ext

    kernels = {args.rev: build_revision(args.rev, SOURCE), "working tree": _ext()}
    stacks = {args.rev: build_revision(args.rev, STACK), "working tree": decode_stack._ext()}
    if kernels["working tree"] is None or stacks["working tree"] is None:
        raise SystemExit("the tiled kernel or the layer loop does not build here (no AVX2/FMA/F16C or no compiler)")
    llm = LLM(args.model, dtype="bfloat16", kv_cache_memory="2GiB", num_threads=args.threads, enable_prefix_caching=False)
    eng = llm.engine
    mods = [m for m in eng.runner.model.modules() if isinstance(m, TiledLinear)]
    rows = []

    def use(name: str) -> Callable[[], None]:
        def switch() -> None:
            for m in mods:
                m._gemm = kernels[name].gemm
            decode_stack._ext = lambda: stacks[name]  # read at every step (decode_stack.run_layers)
        return switch

    for b in [int(x) for x in args.batch.split(",")]:
        ms = alternate(eng, b, args.context, {k: use(k) for k in kernels}, args.rounds, args.steps)
        med = medians(ms)
        rows.append({"batch": b, "context": args.context, "median_ms_per_step": med, "runs_ms": ms,
                     "ratio": med["working tree"] / med[args.rev]})
    print(f"\n{len(mods)} kvserve_tiled modules in the plan; decode ms per engine step (median of {args.rounds} rounds)")
    print(f"{'batch':>6} {args.rev:>14} {'working tree':>14} {'ratio':>7}")
    for r in rows:
        m = r["median_ms_per_step"]
        print(f"{r['batch']:>6} {m[args.rev]:>14.1f} {m['working tree']:>14.1f} {r['ratio']:>7.3f}")
    doc = {"cpu": cpu, "command": " ".join(["python", "benchmarks/tiled_ab.py", *sys.argv[1:]]), "rev": args.rev,
           "threads": args.threads, "tiled_modules": len(mods), "rows": rows,
           "kernel_choices": [{"role": c.role, "band": c.band, "choice": c.choice} for c in choices()]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
