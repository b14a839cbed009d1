"""Throughput side by side: kvserve, transformers and (when installed) llama.cpp, in one run.

Same random-weight Qwen2.5-0.5B-shaped checkpoint, same prompts, bf16 (llama.cpp: the GGUF in
the same precision), same thread count. Each engine runs in its own subprocess so its peak RSS is
its own. Measured per engine:

* prefill tokens/s at 512 and 2048 prompt tokens;
* single-stream decode tokens/s at 512 and 2048 context;
* 16 concurrent requests (prompt 256, 128 new tokens): total generated tokens/s;
* peak RSS;
* the memory-bandwidth bound: bytes read per decode step (weights + KV at that context) ÷ the
  read bandwidth measured in this run, and each engine's share of it.

    python benchmarks/throughput.py                       # full run, ~15 min on 2 cores
    python benchmarks/throughput.py --quick               # shorter prompts/decodes, a smoke run
    python benchmarks/throughput.py --engines kvserve,transformers

Prints a table and writes JSON (default benchmarks/results/throughput.json). The machine is
shared and noisy: every figure comes with its ratio to the others from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache"
ENGINES = ("kvserve", "transformers", "llama.cpp")


# --------------------------------------------------------------------------------------------
# shared helpers
def prompt_ids(n: int, seed: int = 0, vocab: int = 4000) -> list[int]:
    """Deterministic token ids in [10, vocab)."""
    return [10 + (i * 7919 + seed * 104729) % (vocab - 10) for i in range(n)]


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: the best of a few full passes summing a large array."""
    import numpy as np

    a = np.ones(int(gib * 2**30) // 8, dtype=np.float64)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def ensure_model(path: Path, dtype: str) -> Path:
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "kvserve.cli", "make-model", "--preset", "qwen2.5-0.5b",
                        "--out", str(path), "--dtype", dtype], check=True)
    return path


def weights_bytes(model: Path) -> int:
    return sum(f.stat().st_size for f in model.glob("*.safetensors"))


# --------------------------------------------------------------------------------------------
# workers: one per engine, run in a subprocess, print one JSON line
def worker_kvserve(args: argparse.Namespace) -> dict:
    from kvserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory="3GiB", num_threads=args.threads,
              max_num_batched_tokens=max(args.prefill), max_num_seqs=32, enable_prefix_caching=False)
    eng = llm.engine

    def run_one(ids: list[int], new: int) -> tuple[float, float]:
        rid = eng.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
        t0 = time.perf_counter()
        first = None
        while True:
            for out in eng.step():
                if out.request_id == rid and first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
                if out.request_id == rid and out.finished:
                    end = time.perf_counter()
                    return first - t0, (end - first) / max(new - 1, 1)

    run_one(prompt_ids(64, 9), 4)  # warm-up
    res: dict = {"prefill_tok_s": {}, "decode_tok_s": {}}
    for n in args.prefill:
        res["prefill_tok_s"][n] = n / median([run_one(prompt_ids(n, r), 1)[0] for r in range(args.repeats)])
    for n in args.context:
        res["decode_tok_s"][n] = 1.0 / run_one(prompt_ids(n, 3), args.decode_tokens)[1]
    reqs = [{"prompt_token_ids": prompt_ids(args.batch_prompt, 100 + i)} for i in range(args.batch)]
    t = time.perf_counter()
    outs = llm.generate(reqs, SamplingParams(max_tokens=args.batch_new, temperature=0, ignore_eos=True))
    dt = time.perf_counter() - t
    res["batch_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
    res["kv_bytes_per_token"] = eng.capacity.bytes_per_token
    return res


def worker_transformers(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(args.threads)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()

    @torch.inference_mode()
    def run_one(ids: list[int], new: int) -> tuple[float, float]:
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        tok = logits[0, -1].argmax()
        first = time.perf_counter()
        for _ in range(new - 1):
            logits = model(tok.view(1, 1), past_key_values=cache, use_cache=True).logits
            tok = logits[0, -1].argmax()
        end = time.perf_counter()
        return first - t0, (end - first) / max(new - 1, 1)

    run_one(prompt_ids(64, 9), 4)
    res: dict = {"prefill_tok_s": {}, "decode_tok_s": {}}
    for n in args.prefill:
        res["prefill_tok_s"][n] = n / median([run_one(prompt_ids(n, r), 1)[0] for r in range(args.repeats)])
    for n in args.context:
        res["decode_tok_s"][n] = 1.0 / run_one(prompt_ids(n, 3), args.decode_tokens)[1]
    with torch.inference_mode():
        batch = torch.tensor([prompt_ids(args.batch_prompt, 100 + i) for i in range(args.batch)])
        t = time.perf_counter()
        out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.batch_new,
                             min_new_tokens=args.batch_new, do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t
    res["batch_tok_s"] = (out.shape[1] - batch.shape[1]) * args.batch / dt
    return res


def worker_llama_cpp(args: argparse.Namespace) -> dict:
    import llama_cpp

    from benchmarks.llama_cpp_convert import to_gguf

    gguf = to_gguf(Path(args.model), CACHE / "qwen2.5-0.5b-bf16.gguf", "bf16" if args.dtype == "bfloat16" else "f16")
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=max(args.context + args.prefill) + args.decode_tokens + 8,
                          n_threads=args.threads, n_threads_batch=args.threads, n_batch=max(args.prefill),
                          n_ubatch=512, verbose=False)

    def run_one(ids: list[int], new: int) -> tuple[float, float]:
        llm.reset()
        t0 = time.perf_counter()
        first = None
        n = 0
        for _ in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if n == new:
                break
        end = time.perf_counter()
        return first - t0, (end - first) / max(new - 1, 1)

    run_one(prompt_ids(64, 9), 4)
    res: dict = {"prefill_tok_s": {}, "decode_tok_s": {}}
    for n in args.prefill:
        res["prefill_tok_s"][n] = n / median([run_one(prompt_ids(n, r), 1)[0] for r in range(args.repeats)])
    for n in args.context:
        res["decode_tok_s"][n] = 1.0 / run_one(prompt_ids(n, 3), args.decode_tokens)[1]
    res["batch_tok_s"] = None  # the high-level API runs one sequence at a time
    res["note"] = "batch: n/a (llama-cpp-python's Llama runs one sequence; see docs/benchmarks.md)"
    return res


WORKERS = {"kvserve": worker_kvserve, "transformers": worker_transformers, "llama.cpp": worker_llama_cpp}


def run_worker(engine: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", engine, "--model", str(args.model), "--dtype", args.dtype,
           "--threads", str(args.threads), "--repeats", str(args.repeats)]
    if args.quick:
        cmd.append("--quick")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(lines[-1])


# --------------------------------------------------------------------------------------------
def report(doc: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    engines = [e for e in doc["engines"] if "error" not in doc["engines"][e]]
    table = Table(title=f"Qwen2.5-0.5B shape, {doc['dtype']}, {doc['threads']} threads; "
                        f"read bandwidth {doc['bandwidth_gb_s']:.1f} GB/s (measured in this run)")
    table.add_column("metric")
    for e in engines:
        table.add_column(e, justify="right")

    def row(name: str, get, fmt: str = "{:.1f}") -> None:
        vals = []
        for e in engines:
            v = get(doc["engines"][e])
            vals.append("n/a" if v is None else fmt.format(v))
        table.add_row(name, *vals)

    for n in doc["prefill"]:
        row(f"prefill tok/s @{n}", lambda d, n=n: d["prefill_tok_s"].get(str(n), d["prefill_tok_s"].get(n)))
    for n in doc["context"]:
        row(f"decode tok/s @{n}", lambda d, n=n: d["decode_tok_s"].get(str(n), d["decode_tok_s"].get(n)))
        row(f"  ms/token @{n}", lambda d, n=n: 1e3 / d["decode_tok_s"].get(str(n), d["decode_tok_s"].get(n)))
        row(f"  share of bandwidth bound @{n}", lambda d, n=n: d["bound_share"].get(str(n), d["bound_share"].get(n)),
            "{:.0%}")
    row(f"{doc['batch']} requests ({doc['batch_prompt']}+{doc['batch_new']}) tok/s", lambda d: d.get("batch_tok_s"))
    row("peak RSS (GiB)", lambda d: d["peak_rss_bytes"] / 2**30, "{:.2f}")
    console = Console(record=True, width=120)
    console.print(table)
    for name, r in doc.get("ratios", {}).items():
        console.print(f"{name}: {r:.2f}")
    return console.export_text()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="short prompts and decodes (smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "throughput.json")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.prefill = [128, 256] if args.quick else [512, 2048]
    args.context = [128, 256] if args.quick else [512, 2048]
    args.decode_tokens = 16 if args.quick else 64
    args.batch, args.batch_prompt, args.batch_new = (4, 64, 16) if args.quick else (16, 256, 128)

    if args.worker:
        res = WORKERS[args.worker](args)
        res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(res))
        return

    ensure_model(args.model, args.dtype)
    wbytes = weights_bytes(args.model)
    bw_start = measure_bandwidth()
    results = {}
    for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
        if engine == "llama.cpp":
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                results[engine] = {"error": ["llama-cpp-python not installed (benchmarks/setup_llama_cpp.sh)"]}
                continue
        print(f"running {engine} ...", file=sys.stderr)
        results[engine] = run_worker(engine, args)
    bw = 0.5 * (bw_start + measure_bandwidth())
    doc = {"dtype": args.dtype, "threads": args.threads, "prefill": args.prefill, "context": args.context,
           "batch": args.batch, "batch_prompt": args.batch_prompt, "batch_new": args.batch_new,
           "weights_bytes": wbytes, "bandwidth_gb_s": bw, "bandwidth_gb_s_start": bw_start, "engines": results}
    kv_bpt = next((r.get("kv_bytes_per_token") for r in results.values() if r.get("kv_bytes_per_token")), 12288)
    for r in results.values():
        if "error" in r:
            continue
        r["bound_share"] = {}
        for n, tps in r["decode_tok_s"].items():
            bound = bw * 1e9 / (wbytes + int(n) * kv_bpt)
            r["bound_share"][n] = tps / bound
    ok = {e: r for e, r in results.items() if "error" not in r}
    ratios = {}
    if "kvserve" in ok:
        k = ok["kvserve"]
        for other in ("llama.cpp", "transformers"):
            if other in ok:
                o = ok[other]
                for n in k["decode_tok_s"]:
                    ratios[f"kvserve/{other} decode @{n}"] = k["decode_tok_s"][n] / o["decode_tok_s"][n]
                for n in k["prefill_tok_s"]:
                    ratios[f"kvserve/{other} prefill @{n}"] = k["prefill_tok_s"][n] / o["prefill_tok_s"][n]
                if o.get("batch_tok_s"):
                    ratios[f"kvserve/{other} batch"] = k["batch_tok_s"] / o["batch_tok_s"]
        ctx = [str(c) for c in args.context]
        ms = {c: 1e3 / k["decode_tok_s"][c] for c in ctx}
        ratios[f"kvserve ms/token @{ctx[-1]} ÷ @{ctx[0]}"] = ms[ctx[-1]] / ms[ctx[0]]
    doc["ratios"] = ratios
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(report(doc))
    for e, r in results.items():
        if "error" in r:
            print(f"{e}: skipped: {r['error'][-1]}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
