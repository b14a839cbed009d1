"""The embedded chat model on its timed GEMM plan against torch's bf16 matmul everywhere (the
untimed default it ran on before session 11), inside one engine, rounds alternating.

    python benchmarks/small_model_gemm.py                      # batches of 1, 4 and 16, 256-token prompts
    python benchmarks/small_model_gemm.py --batch 1 --rounds 10

The model is loaded twice, once on the plan :mod:`kvserve.model.gemm_plan` measures (or reads
from its cache) and once forced to ``native`` (``cpu_fp16_gemm=False``: torch's matmul on the
loaded bf16 weights); the engine's runner is switched between the two each round, so both see the
same KV, sequences and host drift. Prints the CPU, the plan and a table of ms per decode step;
writes JSON (default ``benchmarks/results/small_model_gemm.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine_ab import by_batch, model_switches, print_rows

from kvserve import LLM
from kvserve.assets import default_model_path
from kvserve.bench.machine import cpu_info
from kvserve.model.loader import load_model
from kvserve.native.choices import choices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model_path())
    ap.add_argument("--batch", default="1,4,16", help="sequences decoding together, comma-separated")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="timed engine steps per round and variant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "small_model_gemm.json")
    a = ap.parse_args()
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {a.threads}")
    sizes = [int(x) for x in a.batch.split(",")]
    llm = LLM(a.model, kv_cache_memory="512MiB", num_threads=a.threads, max_num_seqs=max(sizes),
              enable_prefix_caching=False)
    eng = llm.engine
    plan = [{"role": c.role, "band": c.band, "choice": c.choice, "source": c.source} for c in choices()
            if c.role.startswith("gemm_")]
    for c in plan:
        print(f"  {c['role']:<13} {c['band']:<9} {c['choice']} ({c['source']})")
    timed = eng.runner.model
    untimed, _ = load_model(a.model, dtype=eng.model_config.dtype, cpu_fp16_gemm=False)
    variants = {"timed plan": timed, "torch bf16 (untimed)": untimed}
    rows = by_batch(eng, sizes, a.context, model_switches(eng, variants), a.rounds, a.steps)
    eng.runner.model = timed
    print_rows(rows, f"decode ms per engine step, {a.context}-token prompts (median of {a.rounds} rounds of {a.steps})")
    doc = {"cpu": cpu, "command": " ".join(["python", "benchmarks/small_model_gemm.py", *sys.argv[1:]]),
           "threads": a.threads, "context": a.context, "plan": plan, "rows": rows}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
