"""OpenMP's wait policy against decode speed: libgomp's default (workers spin a while after each
parallel region, then sleep) against ``OMP_WAIT_POLICY=PASSIVE`` (they sleep at once), each in
fresh processes (libgomp reads the policy when torch loads it), the policies alternating.

    python benchmarks/omp_wait.py                  # 3 rounds, ~6 min on 2 cores
    python benchmarks/omp_wait.py --hog 1 --rounds 2   # with one busy-looping process beside it

A decode step of the 0.5B shape makes ~170 OpenMP parallel regions (GEMMs, attention, norms,
rope, SiLU·mul) a few microseconds apart; with ``PASSIVE`` each wakes a sleeping worker through
the kernel. Per process: ms per decode step (median) of the embedded model and of the 0.5B shape
at 1 and 16 sequences (256-token prompts). ``--hog N`` starts N processes that spin on a core for
the whole run: an oversubscribed host, where spinning workers fight the other work for the cores.
Prints the CPU, a table (median over rounds) and writes JSON (default
``benchmarks/results/omp_wait.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {"default": None, "PASSIVE": "PASSIVE"}
FIGURES = ("tiny_b1", "tiny_b16", "q05_b1", "q05_b16")


def child() -> None:
    """One process: the figures under the policy it was started with (torch loaded after the env)."""
    import torch  # noqa: F401 - libgomp reads OMP_WAIT_POLICY now

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from throughput import CACHE, prompt_ids

    from kvserve import LLM, SamplingParams

    def step_ms(eng, batch: int, n: int) -> float:  # type: ignore[no-untyped-def]
        for i in range(batch):
            eng.add_request({"prompt_token_ids": prompt_ids(256, 100 + i)},
                            SamplingParams(max_tokens=n + 20, temperature=0, ignore_eos=True))
        started: set[str] = set()
        while len(started) < batch:
            started |= {o.request_id for o in eng.step() if o.outputs[0].token_ids}
        eng.step()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t)
        while eng.has_unfinished_requests():
            eng.step()
        return statistics.median(ts) * 1e3

    tiny = LLM(None, kv_cache_memory="256MiB", num_threads=2, enable_prefix_caching=False).engine
    out = {"tiny_b1": step_ms(tiny, 1, 60), "tiny_b16": step_ms(tiny, 16, 30)}
    big = LLM(CACHE / "qwen2.5-0.5b", dtype="bfloat16", kv_cache_memory="1GiB", num_threads=2,
              enable_prefix_caching=False).engine
    out.update(q05_b1=step_ms(big, 1, 20), q05_b16=step_ms(big, 16, 10))
    print("RESULT " + json.dumps(out))


def run_child(policy: str | None) -> dict[str, float]:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    proc = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hog", type=int, default=0, help="busy-looping processes beside the measurement")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "omp_wait.json")
    a = ap.parse_args()
    if a.child:
        child()
        return
    from kvserve.bench.machine import cpu_info

    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: 2  busy processes beside: {a.hog}")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.hog)]
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    try:
        for r in range(a.rounds):
            for name in (list(POLICIES) if r % 2 == 0 else list(POLICIES)[::-1]):
                runs[name].append(run_child(POLICIES[name]))
                print(f"  round {r + 1} {name:<8} " + "  ".join(f"{k} {v:.2f}" for k, v in runs[name][-1].items()))
    finally:
        for h in hogs:
            h.kill()
    med = {p: {f: statistics.median(x[f] for x in runs[p]) for f in FIGURES} for p in POLICIES}
    print(f"\nms per decode step, median of {a.rounds} processes per policy")
    print(f"{'figure':<10} {'default':>9} {'PASSIVE':>9} {'default/PASSIVE':>16}")
    for f in FIGURES:
        print(f"{f:<10} {med['default'][f]:>9.2f} {med['PASSIVE'][f]:>9.2f} {med['default'][f] / med['PASSIVE'][f]:>16.2f}")
    doc = {"cpu": cpu, "command": " ".join(["python", "benchmarks/omp_wait.py", *sys.argv[1:]]), "hog": a.hog,
           "rounds": a.rounds, "median_ms": med, "runs_ms": runs}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
