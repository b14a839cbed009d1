"""The native layer loop (kvserve/model/decode_stack.py) against the per-layer Python path, inside
one engine, rounds alternating (``KVSERVE_DECODE_STACK`` switched between them).

    python benchmarks/decode_stack.py                  # 0.5B shape, 1 and 16 sequences, 512 tokens

Both variants run the same kernels on the same weights, KV and sequences (the stack is bit-equal
to the per-layer path), so the difference is Python, dispatch and the thread hand-offs around
them. Prints the CPU, the GEMM plan and ms per decode step; writes JSON (default
``benchmarks/results/decode_stack.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine_ab import by_batch, print_rows
from throughput import CACHE

from kvserve import LLM
from kvserve.bench.machine import cpu_info
from kvserve.native.choices import choices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "decode_stack.json")
    a = ap.parse_args()
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {a.threads}")
    sizes = [int(x) for x in a.batch.split(",")]
    llm = LLM(a.model, dtype="bfloat16", kv_cache_memory="2GiB", num_threads=a.threads, max_num_seqs=max(sizes),
              enable_prefix_caching=False)
    plan = {c.role: c.choice for c in choices() if c.role.startswith("gemm_") and c.band == "rows<=1"}
    print("GEMM paths at one row: " + ", ".join(f"{r[5:]} {p}" for r, p in plan.items()))

    def env(value: str) -> Callable[[], None]:
        def switch() -> None:
            os.environ["KVSERVE_DECODE_STACK"] = value
        return switch

    variants = {"native loop": env("1"), "per layer": env("0")}
    rows = by_batch(llm.engine, sizes, a.context, variants, a.rounds, a.steps)
    print_rows(rows, f"decode ms per engine step, {a.context}-token prompts (median of {a.rounds} rounds of {a.steps})")
    doc = {"cpu": cpu, "command": " ".join(["python", "benchmarks/decode_stack.py", *sys.argv[1:]]),
           "threads": a.threads, "context": a.context, "plan_rows1": plan, "rows": rows}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
