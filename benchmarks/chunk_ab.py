"""What the 128-row band and the layer loop's 128 rows buy a chat turn's chunk: time to first token
of an n-token prompt, three variants switched inside one engine, rounds alternating.

* ``now``: the plan as timed (``rows<=128`` on its own path; the native layer loop up to 128 rows);
* ``loop to 64``: the same paths, the layer loop limited to 64 rows (``decode_stack.MAX_ROWS``, as
  before session 18);
* ``before``: also every ``rows<=128`` band on the prompt band's path (``rows>128``): session 17's
  behaviour, when anything over 64 rows ran on the path timed for 256-row prompts.

A turn after the first is its message plus the last answer's final token (65 tokens in ``kvserve
bench turns``), hence the default sizes.

    PYTHONPATH=$PWD python benchmarks/chunk_ab.py                 # 64, 65, 96, 128 tokens, 9 rounds
    PYTHONPATH=$PWD python benchmarks/chunk_ab.py --tokens 65 --rounds 15

Prints a table of medians and paired ratios (``now``'s time over each variant's, round by round)
and writes JSON (default
``benchmarks/results/chunk_ab.json``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kv_quant import paired_ratio, paired_text
from throughput import CACHE, ensure_model

from kvserve import LLM, SamplingParams
from kvserve.bench.machine import cpu_info
from kvserve.bench.results import write_json
from kvserve.model import decode_stack
from kvserve.model.gemm_paths import BANDS, BandDispatch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--tokens", default="64,65,96,128", help="prompt sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "chunk_ab.json")
    a = ap.parse_args(argv)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {a.threads}", file=sys.stderr)
    ensure_model(a.model, "bfloat16")
    eng = LLM(a.model, dtype="bfloat16", kv_cache_memory="1GiB", num_threads=a.threads,
              enable_prefix_caching=False).engine
    model = eng.runner.model
    disp = [m for m in model.modules() if isinstance(m, BandDispatch)]
    planned = {id(m): m.band_path for m in disp}
    chunk, top, loop_rows = BANDS.index("rows<=128"), len(BANDS) - 1, decode_stack.MAX_ROWS

    def switch(band_on_top: bool, max_rows: int) -> None:
        for m in disp:
            bp = planned[id(m)]
            m.band_path = tuple(bp[top] if band_on_top and b == chunk else p for b, p in enumerate(bp))
        decode_stack.MAX_ROWS = max_rows
        decode_stack.forget(model)  # the loop looks at the bands' modules again

    variants = {"now": (False, loop_rows), "loop to 64": (False, 64), "before": (True, 64)}

    def ttft(n: int, seed: int) -> float:
        rng = random.Random(seed)
        eng.add_request({"prompt_token_ids": [rng.randrange(10, 50000) for _ in range(n)]},
                        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        return (time.perf_counter() - t0) * 1e3

    rows = {}
    try:
        for n in (int(x) for x in a.tokens.split(",")):
            ms: dict[str, list[float]] = {v: [] for v in variants}
            for v, args in variants.items():  # warm-up
                switch(*args)
                ttft(n, 0)
            for r in range(a.rounds):
                for v in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                    switch(*variants[v])
                    ms[v].append(ttft(n, r + 1))
            rows[str(n)] = {"median_ms": {v: statistics.median(x) for v, x in ms.items()}, "runs_ms": ms,
                            "paired_now_vs": {v: paired_ratio(ms["now"], ms[v]) for v in variants if v != "now"}}
    finally:
        switch(False, loop_rows)
    print(f"{'tokens':>6} {'now ms':>8} {'loop to 64 ms':>14} {'before ms':>10} "
          f"{'now ÷ loop to 64, paired':>26} {'now ÷ before, paired':>22}")
    for n, row in rows.items():
        m, p = row["median_ms"], row["paired_now_vs"]
        print(f"{n:>6} {m['now']:>8.1f} {m['loop to 64']:>14.1f} {m['before']:>10.1f} "
              f"{paired_text(p['loop to 64']):>26} {paired_text(p['before']):>22}")
    write_json(a.json, {"cpu": cpu, "threads": a.threads, "command": " ".join(sys.argv), "rounds": a.rounds,
                        "dispatched_modules": len(disp), "tokens": rows})


if __name__ == "__main__":
    main()
