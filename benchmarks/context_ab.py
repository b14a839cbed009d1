"""Issue 14's ms/token target (2,048-token context ≤ 1.10x 512) in one engine, contexts alternating.

    python benchmarks/context_ab.py                  # 0.5B shape, 6 rounds of 12 decode steps each

``benchmarks/throughput.py`` times each context in its own block of runs; on a shared host whose
speed drifts ±20 % within minutes that moves the ratio more than attention does. Here each round
decodes one sequence at 512 and one at 2,048 context (order reversed every other round), so both
see the same drift. Prints the CPU, per-round and median ms per decode step and the ratio; writes
JSON (default ``benchmarks/results/context_ab.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import CACHE, prompt_ids

from kvserve import LLM, SamplingParams
from kvserve.bench.machine import cpu_info


def decode_ms(eng, context: int, seed: int, steps: int) -> float:  # type: ignore[no-untyped-def]
    rid = eng.add_request({"prompt_token_ids": prompt_ids(context, seed)},
                          SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    while not any(o.request_id == rid and o.outputs[0].token_ids for o in eng.step()):
        pass
    eng.step()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    ms = (time.perf_counter() - t) / steps * 1e3
    eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    eng.step()  # the abort's output
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "context_ab.json")
    a = ap.parse_args()
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {a.threads}")
    contexts = [int(x) for x in a.contexts.split(",")]
    llm = LLM(a.model, dtype="bfloat16", kv_cache_memory="2GiB", num_threads=a.threads, enable_prefix_caching=False)
    runs: dict[int, list[float]] = {c: [] for c in contexts}
    for r in range(a.rounds):
        for c in (contexts if r % 2 == 0 else contexts[::-1]):
            runs[c].append(decode_ms(llm.engine, c, 7 + r, a.steps))
        print(f"  round {r + 1}: " + "  ".join(f"{c} tokens {runs[c][-1]:.2f} ms" for c in contexts), flush=True)
    med = {c: statistics.median(v) for c, v in runs.items()}
    ratio = med[contexts[-1]] / med[contexts[0]]
    print("median ms per decode step: " + "  ".join(f"{c}: {m:.2f}" for c, m in med.items())
          + f"   ratio {contexts[-1]}/{contexts[0]}: {ratio:.3f}")
    doc = {"cpu": cpu, "command": " ".join(["python", "benchmarks/context_ab.py", *sys.argv[1:]]),
           "threads": a.threads, "runs_ms": runs, "median_ms": med, "ratio": ratio}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
