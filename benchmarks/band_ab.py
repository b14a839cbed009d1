"""What the GEMM plan's 64-row band buys: decode steps of mid-size batches with the band on its
own path against the band taking the prompt band's path (``rows>128``; the plan before session
10, when everything above 16 rows ran there), switched inside one engine, rounds alternating.

    python benchmarks/band_ab.py                      # batches of 32 and 48 sequences of 256 tokens
    python benchmarks/band_ab.py --batch 24,64 --rounds 8

Every :class:`~kvserve.model.gemm_paths.BandDispatch` of the loaded model is switched between its
planned ``band_path`` and one whose ``rows<=64`` entry is the last band's; roles whose plan
names one path for every band are not dispatched and do not change. Prints the CPU, the plan and
a table, and writes JSON (default ``benchmarks/results/band_ab.json``).
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
from throughput import CACHE

from kvserve import LLM
from kvserve.bench.machine import cpu_info
from kvserve.model import decode_stack
from kvserve.model.gemm_paths import BANDS, BandDispatch
from kvserve.native.choices import choices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--batch", default="32,48", help="sequences decoding together, comma-separated")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3, help="timed engine steps per round and variant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "band_ab.json")
    a = ap.parse_args()
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {a.threads}")
    sizes = [int(x) for x in a.batch.split(",")]
    llm = LLM(a.model, dtype="bfloat16", kv_cache_memory="3GiB", num_threads=a.threads, max_num_seqs=max(sizes),
              enable_prefix_caching=False)
    eng = llm.engine
    plan = [{"role": c.role, "band": c.band, "choice": c.choice, "timings_us": c.timings_us} for c in choices()
            if c.role.startswith("gemm_")]
    for c in plan:
        print(f"  {c['role']:<13} {c['band']:<9} {c['choice']}")
    mid, top = BANDS.index("rows<=64"), len(BANDS) - 1
    disp = [m for m in eng.runner.model.modules() if isinstance(m, BandDispatch)]
    planned = {id(m): m.band_path for m in disp}
    variants = {
        "rows<=64 planned": lambda bp: bp,
        f"rows<=64 on the {BANDS[top]} path": lambda bp: tuple(bp[top] if b == mid else p for b, p in enumerate(bp)),
    }

    def use(name: str) -> Callable[[], None]:
        def switch() -> None:
            for m in disp:
                m.band_path = variants[name](planned[id(m)])
            decode_stack.forget(eng.runner.model)  # the layer loop looks at the bands' modules again
        return switch

    rows = []
    for b in sizes:
        ms = alternate(eng, b, a.context, {k: use(k) for k in variants}, a.rounds, a.steps)
        med = medians(ms)
        names = list(variants)
        rows.append({"batch": b, "median_ms_per_step": med, "runs_ms": ms, "ratio": med[names[0]] / med[names[1]]})
    for m in disp:
        m.band_path = planned[id(m)]
    names = list(variants)
    print(f"\ndecode ms per engine step, {a.context}-token prompts (median of {a.rounds} rounds)")
    print(f"{'batch':>6} {names[0]:>18} {names[1]:>30} {'ratio':>7}")
    for r in rows:
        m = r["median_ms_per_step"]
        print(f"{r['batch']:>6} {m[names[0]]:>18.1f} {m[names[1]]:>30.1f} {r['ratio']:>7.3f}")
    doc = {"cpu": cpu, "command": " ".join(["python", "benchmarks/band_ab.py", *sys.argv[1:]]), "threads": a.threads,
           "context": a.context, "plan": plan, "dispatched_modules": len(disp), "rows": rows}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
