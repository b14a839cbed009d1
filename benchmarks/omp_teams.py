"""One OpenMP team per process, against two (kvserve/native/omp.py), each case in fresh processes,
the cases alternating.

    python benchmarks/omp_teams.py              # 3 rounds, ~4 min on 2 cores

libgomp gives each thread that opens a parallel region a team of its own; with more OpenMP threads
than CPUs it throttles every team's spin-wait. Cases, ms per decode step (median) of the 0.5B
shape, one sequence, 48 steps:

* ``loading``: decoded on the thread that loaded the model (the ``LLM`` API);
* ``other``: decoded on another thread, the loading thread's team kept (the server until session
  12: it loads on the main thread and steps on ``kvserve-engine``);
* ``released``: the same after :func:`kvserve.native.omp.release_team` on the loading thread
  (what ``AsyncLLMEngine.start`` now does).

And the GEMM timing's case: the tiled kernel's one-row GEMV on 48 distinct qkv-shaped matrices
(past the last-level cache), us per call, before and after a helper thread ran one 16-row SiLU·mul
(a parallel op, as FBGEMM's shard threads did) ``plain`` or after
:func:`~kvserve.native.omp.single_thread_here` (``pinned``, the shard pool now).

Prints the CPU, a table (medians over rounds) and writes JSON (default
``benchmarks/results/omp_teams.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("loading", "other", "released")


def _gemv_us(mods: list, x) -> float:  # type: ignore[no-untyped-def]
    passes = []
    for _ in range(7):
        t = time.perf_counter()
        for m in mods:
            m(x)
        passes.append((time.perf_counter() - t) / len(mods))
    return statistics.median(passes) * 1e6


def child_gemv(helper: str) -> dict[str, float]:
    import torch

    from kvserve.model.tiled_gemm import TiledLinear
    from kvserve.native import fused
    from kvserve.native.omp import single_thread_here

    torch.set_num_threads(2)
    mods = [TiledLinear(torch.randn(1152, 896).to(torch.bfloat16), None) for _ in range(48)]
    x = torch.randn(1, 896).to(torch.bfloat16)
    with torch.inference_mode():
        _gemv_us(mods, x)
        before = _gemv_us(mods, x)

        done, keep = threading.Event(), threading.Event()

        def helper_work() -> None:
            if helper == "pinned":
                single_thread_here()
            fused.silu_mul(torch.randn(16, 2 * 4864), 4864, torch.bfloat16)
            done.set()
            keep.wait()  # alive, as a pool thread is: its team (if it got one) lives with it

        threading.Thread(target=helper_work, daemon=True).start()
        done.wait()
        after = _gemv_us(mods, x)
        keep.set()
    return {"before": before, "after": after}


def child_decode(case: str) -> float:
    import concurrent.futures as cf

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from throughput import CACHE

    from kvserve import LLM, SamplingParams
    from kvserve.native.omp import release_team

    llm = LLM(CACHE / "qwen2.5-0.5b", dtype="bfloat16", kv_cache_memory="1GiB", num_threads=2,
              enable_prefix_caching=False)
    eng = llm.engine

    def decode() -> float:
        eng.add_request({"prompt_token_ids": list(range(1000, 1256))},
                        SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
        eng.step()
        eng.step()
        ts = []
        for _ in range(48):
            t = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t)
        while eng.has_unfinished_requests():
            eng.step()
        return statistics.median(ts) * 1e3

    if case == "loading":
        decode()
        return decode()
    if case == "released":
        release_team()
    with cf.ThreadPoolExecutor(1) as pool:
        pool.submit(decode).result()
        return pool.submit(decode).result()


def run_child(*args: str) -> object:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "omp_teams.json")
    a = ap.parse_args()
    if a.child:
        kind, case = a.child
        print("RESULT " + json.dumps(child_decode(case) if kind == "decode" else child_gemv(case)))
        return
    from kvserve.bench.machine import cpu_info

    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: 2")
    decode: dict[str, list[float]] = {c: [] for c in CASES}
    gemv: dict[str, list[dict[str, float]]] = {"plain": [], "pinned": []}
    for r in range(a.rounds):
        order = CASES if r % 2 == 0 else CASES[::-1]
        for c in order:
            decode[c].append(run_child("decode", c))  # type: ignore[arg-type]
            print(f"  round {r + 1} decode {c:<9} {decode[c][-1]:.2f} ms/step")
        for h in (("plain", "pinned") if r % 2 == 0 else ("pinned", "plain")):
            gemv[h].append(run_child("gemv", h))  # type: ignore[arg-type]
            print(f"  round {r + 1} gemv {h:<7} before {gemv[h][-1]['before']:.1f} us  after {gemv[h][-1]['after']:.1f} us")
    med = {c: statistics.median(v) for c, v in decode.items()}
    print(f"\nms per decode step (0.5B shape, 1 sequence), median of {a.rounds} processes")
    for c in CASES:
        print(f"  {c:<9} {med[c]:7.2f}   {med[c] / med['loading']:.2f}x loading")
    gmed = {h: {k: statistics.median(x[k] for x in v) for k in ("before", "after")} for h, v in gemv.items()}
    print("\ntiled one-row qkv GEMV, us per call, before / after a helper thread's parallel op")
    for h, v in gmed.items():
        print(f"  {h:<7} {v['before']:7.1f} {v['after']:7.1f}   {v['after'] / v['before']:.2f}x")
    doc = {"cpu": cpu, "command": " ".join(["python", "benchmarks/omp_teams.py", *sys.argv[1:]]),
           "rounds": a.rounds, "decode_ms": decode, "decode_median_ms": med, "gemv_us": gemv, "gemv_median_us": gmed}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
