"""Weights on transparent huge pages against 4 KiB pages (kvserve/model/huge_pages.py), side by side.

    python benchmarks/huge_pages.py                 # GEMVs, then decode steps at 1 and 16 sequences

1. **GEMV**: the tiled kernel's one-row product on each of the 0.5B shape's matrices (distinct
   copies, 128 MiB of them a pass: past the last-level cache, as in a decode step), the copies on
   huge pages and on small pages, passes alternating: GB/s read.
2. **decode**: the 0.5B shape loaded twice into one engine, once with ``KVSERVE_HUGE_PAGES=0``; the
   runner switches between the two copies each round (``engine_ab.alternate``): ms per decode step
   at 512-token context.

Prints the CPU, the kernel's THP mode, the resident huge-page bytes and the tables; writes JSON
(default ``benchmarks/results/huge_pages.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch
from engine_ab import by_batch, model_switches, print_rows
from throughput import CACHE

from kvserve import LLM
from kvserve.bench.machine import cpu_info
from kvserve.model import huge_pages
from kvserve.model.loader import load_model
from kvserve.model.tiled_gemm import TiledLinear

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864),
          "lm_head": (151936, 896)}


def gemv(rounds: int) -> dict[str, dict[str, float]]:
    out = {}
    for name, (o, i) in SHAPES.items():
        n = max(1, (128 << 20) // (o * i * 2))
        small = [torch.randn(o, i).to(torch.bfloat16) for _ in range(n)]
        huge = [huge_pages.empty((o, i), torch.bfloat16).copy_(w) for w in small]
        mods = {"small": [TiledLinear(w, None) for w in small], "huge": [TiledLinear(w, None) for w in huge]}
        x = torch.randn(1, i).to(torch.bfloat16)
        t: dict[str, list[float]] = {k: [] for k in mods}
        with torch.inference_mode():
            for r in range(rounds):
                for k in (("small", "huge") if r % 2 == 0 else ("huge", "small")):
                    t0 = time.perf_counter()
                    for m in mods[k]:
                        m(x)
                    t[k].append((time.perf_counter() - t0) / n)
        out[name] = {k: o * i * 2 / statistics.median(v) / 1e9 for k, v in t.items()}
        print(f"  {name:<8} small pages {out[name]['small']:5.1f} GB/s   huge pages {out[name]['huge']:5.1f} GB/s"
              f"   {out[name]['huge'] / out[name]['small']:.2f}x", flush=True)
    return out


def decode(sizes: list[int], context: int, rounds: int, steps: int) -> list[dict[str, object]]:
    model = CACHE / "qwen2.5-0.5b"
    llm = LLM(model, dtype="bfloat16", kv_cache_memory="2GiB", num_threads=2, max_num_seqs=max(sizes),
              enable_prefix_caching=False)
    eng = llm.engine
    os.environ["KVSERVE_HUGE_PAGES"] = "0"
    try:
        small, _ = load_model(model, dtype="bfloat16")  # the same (cached) GEMM plan
    finally:
        del os.environ["KVSERVE_HUGE_PAGES"]
    variants = {"huge pages": eng.runner.model, "small pages": small}
    print(f"  resident on huge pages with both copies loaded: {huge_pages.resident_huge_bytes() / 2**20:.0f} MiB")
    rows = by_batch(eng, sizes, context, model_switches(eng, variants), rounds, steps)
    print_rows(rows, f"decode ms per engine step, {context}-token prompts, median of {rounds} rounds of {steps}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-gemv", action="store_true")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "huge_pages.json")
    a = ap.parse_args()
    torch.set_num_threads(2)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: 2  THP: {huge_pages.thp_mode()}")
    if not huge_pages.enabled():
        raise SystemExit("huge pages are not available here (THP never/absent, or KVSERVE_HUGE_PAGES=0)")
    g = {}
    if not a.skip_gemv:
        print("one-row GEMV on the tiled kernel, 128 MiB of distinct copies a pass")
        g = gemv(a.rounds)
    rows = []
    if not a.skip_decode:
        rows = decode([int(x) for x in a.batch.split(",")], a.context, a.rounds, a.steps)
    doc = {"cpu": cpu, "thp": huge_pages.thp_mode(), "command": " ".join(["python", "benchmarks/huge_pages.py",
           *sys.argv[1:]]), "gemv_gb_s": g, "decode": rows}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
