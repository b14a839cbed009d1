"""What running the model in a child process costs per engine step (``runner="process"`` vs inline).

Both engines serve the same requests on the shipped tiny model (or ``--model``), one after the
other, interleaved per repeat; a step's time is measured around ``LLMEngine.step`` in the decode
phase. The difference is the contract's price: encoding the step records (msgpack), the pipe
round trip and the child's decoding. Prints a table and writes JSON.

    python benchmarks/runner_overhead.py [--model DIR] [--batch 1,8] [--steps 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.bench.machine import cpu_info
from kvserve.engine.llm import resolve_model_path


def decode_step_ms(llm: LLM, batch: int, steps: int) -> list[float]:
    """Per-step wall times (ms) of ``steps`` decode steps of ``batch`` sequences."""
    eng = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request({"prompt_token_ids": [10 + i, 20, 30, 40]}, params)
    eng.step()  # prefill
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t0) * 1e3)
    eng.run_until_done()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/results/runner_overhead.json")
    args = ap.parse_args()
    model = resolve_model_path(args.model)
    kw = {"dtype": "float32", "kv_cache_memory": "64MiB", "num_threads": args.threads}
    engines = {"inline": LLM(model, **kw), "process": LLM(model, runner="process", **kw)}
    info = cpu_info()
    print(f"CPU: {info['model']}  flags: {' '.join(info['flags'])}  threads: {args.threads}  model: {model}")
    results: dict[str, dict[str, float]] = {}
    for batch in (int(b) for b in args.batch.split(",")):
        samples: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                samples[name] += decode_step_ms(llm, batch, args.steps)
        med = {k: statistics.median(v) for k, v in samples.items()}
        results[str(batch)] = {"inline_ms": med["inline"], "process_ms": med["process"],
                               "overhead_ms": med["process"] - med["inline"], "ratio": med["process"] / med["inline"]}
    print(f"{'batch':>5} {'inline ms/step':>15} {'process ms/step':>16} {'overhead ms':>12} {'ratio':>6}")
    for batch, r in results.items():
        print(f"{batch:>5} {r['inline_ms']:>15.3f} {r['process_ms']:>16.3f} {r['overhead_ms']:>12.3f} {r['ratio']:>6.2f}")
    engines["process"].shutdown()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": info, "model": model, "steps": args.steps, "repeats": args.repeats,
                                           "threads": args.threads, "batches": results}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
