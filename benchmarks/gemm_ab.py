"""Two GEMM plans side by side in one process, interleaved: decode ms/token, prefill tok/s and the
step time of a batch's decode phase (``--batch`` sequences of 256 tokens, all decoding).

    python benchmarks/gemm_ab.py                                   # onednn_packed forced vs auto
    python benchmarks/gemm_ab.py --plans kvserve_tiled,auto --rounds 6

Each plan is an engine of its own on the same checkpoint (``auto`` = the measured plan; any other
name is forced with ``KVSERVE_GEMM`` while that engine loads). Rounds alternate the engines, so a
drift of a noisy shared host hits both alike; medians per plan. A single throughput run per
plan is too noisy for a 1.3x decision on such a host (single decode steps ranged 36-80 ms in one
process on the session-9 EPYC). Prints the CPU, a table and writes JSON (default
``benchmarks/results/gemm_ab.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import CACHE, prompt_ids

from kvserve import LLM, SamplingParams
from kvserve.bench.machine import cpu_info


def timed(engine, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """(seconds to the first token, seconds per later token) for these prompts run together."""
    for ids in prompts:
        engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    t0, first, done = time.perf_counter(), None, 0
    while done < len(prompts):
        for out in engine.step():
            first = first or (time.perf_counter() if out.outputs[0].token_ids else None)
            done += out.finished
    return first - t0, (time.perf_counter() - first) / max(new - 1, 1)


def decode_phase(engine, prompts: list[list[int]], steps: int) -> float:
    """Milliseconds per engine step once every prompt has its first token (a batch's decode phase)."""
    rids = {engine.add_request({"prompt_token_ids": ids},
                               SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)) for ids in prompts}
    started: set[str] = set()
    while started != rids:
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * elapsed / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--plans", default="onednn_packed,auto")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16, help="sequences in the decode-phase measurement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "gemm_ab.json")
    args = ap.parse_args()
    info = cpu_info()
    print(f"CPU: {info['model']}  flags: {' '.join(info['flags'])}  threads: {args.threads}  torch {torch.__version__}")
    engines = {}
    for plan in args.plans.split(","):
        if plan == "auto":
            os.environ.pop("KVSERVE_GEMM", None)
        else:
            os.environ["KVSERVE_GEMM"] = plan
        engines[plan] = LLM(str(args.model), dtype="bfloat16", kv_cache_memory="1GiB", num_threads=args.threads,
                            max_num_batched_tokens=2048, max_num_seqs=32,
                            enable_prefix_caching=False).engine
    os.environ.pop("KVSERVE_GEMM", None)
    runs: dict[str, dict[str, list[float]]] = {p: {"decode_ms": [], "prefill_tok_s": [], "batch_step_ms": []}
                                               for p in engines}
    for engine in engines.values():
        timed(engine, [prompt_ids(64, 9)], 4)  # warm-up
    for r in range(args.rounds):
        for plan, engine in engines.items():
            runs[plan]["decode_ms"].append(1e3 * timed(engine, [prompt_ids(args.context, 3 + r)], args.decode_tokens)[1])
            runs[plan]["prefill_tok_s"].append(args.context / timed(engine, [prompt_ids(args.context, 50 + r)], 1)[0])
            batch = [prompt_ids(256, 100 + 20 * r + j) for j in range(args.batch)]
            runs[plan]["batch_step_ms"].append(decode_phase(engine, batch, args.decode_tokens // 2))
    medians = {p: {k: statistics.median(v) for k, v in m.items()} for p, m in runs.items()}
    print(f"{'plan':>16} {'decode ms/token':>16} {'prefill tok/s':>14} {f'{args.batch} x 256 step ms':>18}   "
          f"(medians of {args.rounds}, context {args.context})")
    for plan, m in medians.items():
        print(f"{plan:>16} {m['decode_ms']:>16.1f} {m['prefill_tok_s']:>14.1f} {m['batch_step_ms']:>18.1f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"cpu": info, "torch": torch.__version__, "threads": args.threads,
                                     "command": " ".join(sys.argv), "medians": medians, "runs": runs}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
