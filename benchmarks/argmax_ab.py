"""The sampler's greedy argmax: torch.argmax against kvserve's native kernel
(kvserve/native/argmax.py), alternating call by call, on vocabulary-wide logits.

    python benchmarks/argmax_ab.py                   # Qwen2.5's 151,936 columns, 2 threads

For each row count and dtype, median µs of each, two ways:

* **warm**: the same logits every call (in cache: the kernel's own speed);
* **cold**: a 256 MB buffer is read between calls, as a decode step's weights are before the
  sampler runs, so the logits come from memory (what the engine sees).

Prints a table with the CPU model and flags and writes JSON (default
``benchmarks/results/argmax_ab.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvserve.bench.machine import cpu_info
from kvserve.native.argmax import argmax_rows

ROOT = Path(__file__).resolve().parents[1]


def alternating(fns: dict[str, Callable[[], object]], repeats: int, between: Callable[[], object] | None) -> dict[str, float]:
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            if between is not None:
                between()
            t = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e6 for k, v in ts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "argmax_ab.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {torch.get_num_threads()}")
    sweep = torch.ones(64 << 20)  # 256 MB
    results = []
    print(f"{'dtype':<9} {'rows':>5} {'cache':>5} {'torch µs':>9} {'native µs':>10} {'ratio':>6}")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (int(r) for r in a.rows.split(",")):
            x = torch.randn(rows, a.vocab).to(dtype)
            assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))
            for cache, between in (("warm", None), ("cold", lambda: sweep.sum())):
                r = alternating({"torch": lambda x=x: torch.argmax(x, dim=-1), "native": lambda x=x: argmax_rows(x)},
                                a.repeats, between)
                results.append({"dtype": str(dtype).removeprefix("torch."), "rows": rows, "cache": cache, **r,
                                "ratio": r["native"] / r["torch"]})
                print(f"{results[-1]['dtype']:<9} {rows:>5} {cache:>5} {r['torch']:>9.0f} {r['native']:>10.0f} "
                      f"{r['native'] / r['torch']:>6.2f}", flush=True)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"cpu": cpu, "threads": a.threads, "vocab": a.vocab, "results": results}, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
