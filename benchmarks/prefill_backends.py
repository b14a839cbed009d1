"""Prompt prefill under each attention backend, and the attention choice's own timings per band.

The attention choice (``kvserve/model/attention_choice.py``) times the native kernel and torch's
path on synthetic blocks per band and keeps the faster; this checks that against whole prompts:
for each backend (``--backends``, default ``native,torch_sdpa,auto``) a worker process loads the
model with that backend forced (``auto``: the choice) and times prompts of ``--lengths`` tokens,
one new token each (median of ``--repeats``). The parent prints the CPU, the choice's per-band
timings for the model's attention shape (µs a layer call), and tokens/s per backend and length
with each backend's ratio to ``auto``; writes JSON.

    PYTHONPATH=$PWD python benchmarks/prefill_backends.py
    PYTHONPATH=$PWD python benchmarks/prefill_backends.py --lengths 512,1024,2048 --repeats 5

Session 20 (a 2-core AMX Xeon), before the ``q>512`` band: a 2,048-token prompt ran on the kernel
at 597 tok/s, on torch's causal flash kernel at 1,045.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import CACHE, prompt_ids


def worker(args: argparse.Namespace) -> None:
    from kvserve import LLM, SamplingParams

    lengths = [int(n) for n in args.lengths.split(",")]
    llm = LLM(str(args.model), dtype=args.dtype, kv_cache_memory="1GiB", num_threads=args.threads,
              max_num_batched_tokens=max(lengths), enable_prefix_caching=False, attention_backend=args.worker)
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    out = {}
    for n in lengths:
        llm.generate([{"prompt_token_ids": prompt_ids(n, 99)}], sp)  # warm-up at this length
        ts = []
        for r in range(args.repeats):
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt_ids(n, r)}], sp)
            ts.append(time.perf_counter() - t)
        out[n] = {"tok_s": n / statistics.median(ts), "runs_s": ts}
    print(json.dumps(out))


def choice_timings(model: Path, dtype: str) -> dict[str, dict[str, float]]:
    import torch

    from kvserve.config import ModelConfig
    from kvserve.model import attention_choice
    from kvserve.model.loader import torch_dtype

    cfg = ModelConfig.from_path(model)
    dt = torch_dtype(dtype) if dtype != "auto" else torch_dtype(cfg.dtype)
    torch.set_num_threads(2)
    return attention_choice.measure(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 16, dt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--backends", default="native,torch_sdpa,auto")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "prefill_backends.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from kvserve.bench.machine import cpu_info

    if not args.model.exists():
        subprocess.run([sys.executable, "-m", "kvserve.cli", "make-model", "--preset", "qwen2.5-0.5b",
                        "--out", str(args.model)], check=True)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {args.threads}")
    bands = choice_timings(args.model, args.dtype)
    print("attention choice, µs a layer call:")
    for band, t in bands.items():
        print(f"  {band:28s} " + "  ".join(f"{b} {v:9.0f}" for b, v in t.items()))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    results: dict[str, dict] = {}
    for backend in args.backends.split(","):
        cmd = [sys.executable, __file__, "--worker", backend, "--model", str(args.model), "--lengths", args.lengths,
               "--repeats", str(args.repeats), "--dtype", args.dtype, "--threads", str(args.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        results[backend] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    print(f"\n{'backend':>12} " + " ".join(f"{'@' + n:>16}" for n in args.lengths.split(",")))
    for backend, r in results.items():
        if "error" in r:
            print(f"{backend:>12} failed: {r['error']}")
            continue
        cells = []
        for n in args.lengths.split(","):
            tps = r[n]["tok_s"]
            base = results.get("auto", {}).get(n, {}).get("tok_s")
            cells.append(f"{tps:8.1f}" + (f" ({tps / base:.2f}x)" if base else ""))
        print(f"{backend:>12} " + " ".join(f"{c:>16}" for c in cells))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"cpu": cpu, "command": " ".join(["python", *sys.argv]), "choice_us": bands,
                                     "prefill": results}, indent=1))
    print(f"tok/s (ratio to auto); wrote {args.json}")


if __name__ == "__main__":
    main()
