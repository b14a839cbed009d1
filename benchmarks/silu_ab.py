"""Whole-prompt prefill with the fused SiLU·mul's 16-lane loop against torch's ``silu * up``, in
one process, alternating.

Since session 21 a bf16 ``silu_mul`` of any row count runs the native kernel where the build has
its 16-lane loop (AVX-512 + AVX512-BF16, ``kvserve/native/fused.py``: ``SILU_WIDE_ROWS``); before,
calls past two rows went to torch's ``F.silu(gate) * up``. This loads the 0.5B shape once and times
prompts of ``--lengths`` tokens (one new token), switching ``fused.SILU_WIDE_ROWS`` between the two
every prompt, the order swapped every round (the first round is a warm-up). Prints the CPU, the
median tokens/s of each and their ratio; writes JSON.

    PYTHONPATH=$PWD python benchmarks/silu_ab.py
    PYTHONPATH=$PWD python benchmarks/silu_ab.py --lengths 128,512 --rounds 9
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

from throughput import CACHE, ensure_model, prompt_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "silu_ab.json")
    args = ap.parse_args()

    from kvserve import LLM, SamplingParams
    from kvserve.bench.machine import cpu_info
    from kvserve.native import fused

    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {args.threads}")  # type: ignore[arg-type]
    ensure_model(args.model, "bfloat16")
    lengths = [int(n) for n in args.lengths.split(",")]
    llm = LLM(str(args.model), dtype="bfloat16", kv_cache_memory="1GiB", num_threads=args.threads,
              max_num_batched_tokens=max(lengths), enable_prefix_caching=False)
    ext = fused._ext()
    wide_rows = fused.SILU_WIDE_ROWS
    print(f"16-lane loop in this build: {bool(ext is not None and ext.silu16())}")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    runs: dict[str, dict[int, list[float]]] = {"kernel": {}, "torch": {}}
    for n in lengths:
        for i in range(args.rounds + 1):
            for mode in ("kernel", "torch") if i % 2 else ("torch", "kernel"):
                fused.SILU_WIDE_ROWS = wide_rows if mode == "kernel" else fused.SILU_NATIVE_ROWS
                t0 = time.perf_counter()
                llm.generate([prompt_ids(n, 50 + i)], params)
                if i:  # round 0 warms both
                    runs[mode].setdefault(n, []).append(n / (time.perf_counter() - t0))
    fused.SILU_WIDE_ROWS = wide_rows
    rows = {}
    for n in lengths:
        k, t = statistics.median(runs["kernel"][n]), statistics.median(runs["torch"][n])
        rows[n] = {"kernel_tok_s": k, "torch_tok_s": t, "ratio": k / t}
        print(f"prefill {n:5d} tokens: kernel's silu_mul {k:7.1f} tok/s, torch's silu * up {t:7.1f} tok/s, "
              f"ratio {k / t:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"cpu": cpu, "threads": args.threads, "rounds": args.rounds,
                                     "results": rows, "runs": runs}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
