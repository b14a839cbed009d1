"""Two GEMM plans for one model inside one engine, rounds alternating: the plan
:mod:`kvserve.model.gemm_plan` gives on this machine against one written on the command line.

    python benchmarks/plan_ab.py --other "qkv=native,kvserve_tiled,kvserve_tiled,native;o=fbgemm_fp16_x1,kvserve_tiled,kvserve_tiled,native;mlp=kvserve_tiled,kvserve_tiled,native,native;lm_head=onednn_packed"

``--other`` gives each role's path per band (rows<=1, <=16, <=64, >64; one path for all bands when
only one is named; roles not named keep this machine's plan). The example is the plan session 11's
timings gave the 0.5B shape on the Zen 4 EPYC, before a GEMM-timing pass stopped leaving libgomp
throttled (kvserve/native/omp.py). The model is loaded twice (the second copy on torch's matmul,
then swapped to ``--other``); the engine's runner switches between the two each round, so both see
the same KV, sequences and host drift. Prints the CPU, both plans and ms per decode step; writes
JSON (default ``benchmarks/results/plan_ab.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine_ab import by_batch, model_switches, print_rows
from throughput import CACHE

from kvserve import LLM
from kvserve.bench.machine import cpu_info
from kvserve.model.gemm_apply import apply_plan
from kvserve.model.gemm_paths import BANDS, ROLES
from kvserve.model.gemm_plan import GemmPlan
from kvserve.model.loader import load_model
from kvserve.native.choices import choices


def parse_plan(text: str, base: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    paths = dict(base)
    for part in filter(None, (p.strip() for p in text.split(";"))):
        role, _, spec = part.partition("=")
        if role not in ROLES:
            raise SystemExit(f"--other: unknown role {role!r} (roles: {', '.join(ROLES)})")
        names = tuple(spec.split(","))
        if len(names) not in (1, len(BANDS)):
            raise SystemExit(f"--other: {role} needs 1 or {len(BANDS)} paths, got {len(names)}")
        paths[role] = names * len(BANDS) if len(names) == 1 else names
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--other", required=True, help="role=path[,path,path,path];... (see above)")
    ap.add_argument("--batch", default="1,16", help="sequences decoding together, comma-separated")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="timed engine steps per round and plan")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "plan_ab.json")
    a = ap.parse_args()
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {a.threads}")
    sizes = [int(x) for x in a.batch.split(",")]
    llm = LLM(a.model, dtype="bfloat16", kv_cache_memory="2GiB", num_threads=a.threads, max_num_seqs=max(sizes),
              enable_prefix_caching=False)
    eng = llm.engine
    here: dict[str, list[str]] = {}
    for c in choices():
        if c.role.startswith("gemm_"):
            here.setdefault(c.role[5:], []).append(c.choice)
    mine = {r: tuple(p) for r, p in here.items()}
    other = parse_plan(a.other, mine)
    for name, plan in (("this machine's plan", mine), ("--other", other)):
        print(f"{name}:")
        for r in ROLES:
            print(f"  {r:<8} {' / '.join(plan[r])}")
    second, _ = load_model(a.model, dtype="bfloat16", cpu_fp16_gemm=False)
    apply_plan(second, GemmPlan(other, "forced"))
    variants = {"this machine's plan": eng.runner.model, "--other": second}
    rows = by_batch(eng, sizes, a.context, model_switches(eng, variants), a.rounds, a.steps)
    print_rows(rows, f"decode ms per engine step, {a.context}-token prompts (median of {a.rounds} rounds of {a.steps})")
    doc = {"cpu": cpu, "command": " ".join(["python", "benchmarks/plan_ab.py", *sys.argv[1:]]),
           "threads": a.threads, "context": a.context, "plans": {"this machine's plan": mine, "--other": other},
           "rows": rows}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
