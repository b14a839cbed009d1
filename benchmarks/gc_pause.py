"""How long a full garbage collection stops a loaded engine's process, before and after
``kvserve.engine.gc_heap.freeze_startup_heap`` (what ``kvserve serve`` does before it listens).

    PYTHONPATH=$PWD python benchmarks/gc_pause.py                  # the 0.5B shape
    PYTHONPATH=$PWD python benchmarks/gc_pause.py --model kvserve/assets/models/kvserve-tiny-chat

Loads the engine, decodes a few steps, counts the objects the collector tracks and times
``gc.collect()`` (median of ``--repeats``) with the heap as loaded, then frozen. Prints the CPU
and the figures; writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import CACHE, ensure_model, prompt_ids

from kvserve import LLM, SamplingParams
from kvserve.bench.machine import cpu_info
from kvserve.engine.gc_heap import freeze_startup_heap


def full_collection_ms(repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "gc_pause.json")
    args = ap.parse_args()
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}")
    if args.model == CACHE / "qwen2.5-0.5b":
        ensure_model(args.model, "bfloat16")
    eng = LLM(args.model, dtype="bfloat16", kv_cache_memory="256MiB").engine
    eng.add_request({"prompt_token_ids": prompt_ids(64)}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    tracked = len(gc.get_objects())
    loaded_ms = full_collection_ms(args.repeats)
    frozen = freeze_startup_heap()
    frozen_ms = full_collection_ms(args.repeats)
    left = len(gc.get_objects())
    gc.unfreeze()
    print(f"objects tracked {tracked:,}: a full collection {loaded_ms:.1f} ms; "
          f"{frozen:,} frozen, {left:,} left: {frozen_ms:.2f} ms")
    doc = {"cpu": cpu, "model": str(args.model), "command": " ".join(["python", "benchmarks/gc_pause.py", *sys.argv[1:]]),
           "tracked_objects": tracked, "full_collection_ms": loaded_ms, "frozen_objects": frozen,
           "objects_left": left, "full_collection_frozen_ms": frozen_ms}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
