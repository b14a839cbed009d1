"""Throughput side by side: kvserve, transformers and (when installed) llama.cpp, in one run.

Same random-weight Qwen2.5-0.5B-shaped checkpoint, same prompts, bf16 (llama.cpp: the GGUF in
the same precision), same thread count. Each engine runs in its own subprocess so its peak RSS is
its own. Measured per engine:

* prefill tokens/s at 512 and 2048 prompt tokens;
* single-stream decode tokens/s at 512 and 2048 context;
* 16 concurrent requests (prompt 256, 128 new tokens): total generated tokens/s;
* peak RSS;
* the memory-bandwidth bound: bytes read per decode step (weights + KV at that context) ÷ the
  read bandwidth measured in this run, and each engine's share of it; also the share paired per
  run (each timed decode run against a short bandwidth probe taken right before it, median over
  runs), which a host whose bandwidth drifts within minutes does not skew.

    python benchmarks/throughput.py                       # full run, ~15 min on 2 cores
    python benchmarks/throughput.py --quick               # shorter prompts/decodes, a smoke run
    python benchmarks/throughput.py --engines kvserve,transformers
    python benchmarks/throughput.py --device cuda --engines kvserve,kvserve-eager,transformers

``kvserve-copy`` is kvserve with a 1 GiB budget for second weight copies (``--gemm-extra-memory
1GiB``): on a CPU where one GEMM path wins at one row and another from a few rows up (an AMX
Xeon), the plan then keeps both, and its rows show what that memory buys side by side
(``--engines kvserve,kvserve-copy,llama.cpp``; ratios ``kvserve/kvserve-copy``).
``kvserve-noamx`` is kvserve with the tiled GEMM's AMX tiles switched off (``KVSERVE_TILED_AMX=0``:
its AVX512-BF16 kernel, the default before session 21), for the tiles' gain in the same run.

``--device cuda`` runs kvserve and transformers on the GPU (llama.cpp is not run there); the
bandwidth bound is then the GPU's read bandwidth, measured the same way, and ``kvserve-eager`` is
kvserve with its decode CUDA graphs off (``KVSERVE_CUDA_GRAPHS=0``), so the graphs' gain is a
ratio in the same run. On CUDA each engine first runs a warm-up at every context and batch shape
(kvserve captures its graphs there, transformers' kernels are loaded), and the GPU's peak memory
is reported.

Prints a table and writes JSON (default benchmarks/results/throughput.json). The machine is
shared and noisy: every figure comes with its ratio to the others from the same run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache"
ENGINES = ("kvserve", "transformers", "llama.cpp", "kvserve-eager", "kvserve-copy", "kvserve-noamx")
COPY_MIB = "1024"  # kvserve-copy: kvserve with this GEMM extra-memory budget (--gemm-extra-memory 1GiB)
DEFAULT_ENGINES = ("kvserve", "transformers", "llama.cpp")


# --------------------------------------------------------------------------------------------
# shared helpers
VOCAB = 4000  # prompt ids are drawn below min(this, the model's vocabulary); set in main()


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    """Deterministic token ids in [10, VOCAB)."""
    return [10 + (i * 7919 + seed * 104729) % (VOCAB - 10) for i in range(n)]


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM: unlike ru_maxrss it does not inherit the parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5, device: str = "cpu") -> float:
    """Read bandwidth in GB/s with ``threads`` threads: the best of a few full passes summing a
    large float32 array (torch's reduction splits it over the threads, as a GEMV does its rows);
    on ``cuda`` the GPU's, the same way."""
    import torch

    torch.set_num_threads(threads)
    a = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        a.sum()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9


def probe_bandwidth(threads: int, device: str = "cpu") -> float:
    """A short read-bandwidth probe taken right before each timed decode run (``single_stream``),
    so each run's share of the bound is against the bandwidth of its own minute: on a shared host
    it swung between ~30 and ~65 GB/s within minutes (session 16), while ``measure_bandwidth`` is
    taken once at each end of the whole run. The same measurement over 96 MiB (past a 32 MiB
    last-level cache), best of three; allocated for the probe and freed after."""
    return measure_bandwidth(threads, gib=96 / 1024, repeats=3, device=device)


def sync(device: str) -> None:
    """Wait for the GPU's queued work (timings on CUDA); nothing on the CPU."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def ensure_model(path: Path, dtype: str) -> Path:
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "kvserve.cli", "make-model", "--preset", "qwen2.5-0.5b",
                        "--out", str(path), "--dtype", dtype], check=True)
    return path


def weights_bytes(model: Path) -> int:
    return sum(f.stat().st_size for f in model.glob("*.safetensors"))


def single_stream(run_one, args: argparse.Namespace) -> dict:
    """Prefill tok/s (median of ``repeats``) and decode tok/s per context (median of ``repeats``
    runs of ``decode_tokens``, the contexts interleaved so a drift in the machine's bandwidth hits
    them alike), through an engine's ``run_one(prompt_ids, new_tokens) -> (ttft_s, s_per_token)``,
    after one warm-up request."""
    run_one(prompt_ids(64, 9), 4)
    if args.device != "cpu":  # every shape timed below once first (kvserve captures its graphs)
        for n in args.context:
            run_one(prompt_ids(n, 8), 4)
    res: dict = {"prefill_tok_s": {}, "decode_tok_s": {}, "decode_ms_runs": {n: [] for n in args.context},
                 "decode_probe_gb_s": {n: [] for n in args.context}}
    for n in args.prefill:
        res["prefill_tok_s"][n] = n / median([run_one(prompt_ids(n, r), 1)[0] for r in range(args.repeats)])
    for r in range(args.repeats):
        for n in args.context:
            res["decode_probe_gb_s"][n].append(probe_bandwidth(args.threads, args.device))
            res["decode_ms_runs"][n].append(1e3 * run_one(prompt_ids(n, 3 + r), args.decode_tokens)[1])
    for n in args.context:
        res["decode_tok_s"][n] = 1e3 / median(res["decode_ms_runs"][n])
    return res


# --------------------------------------------------------------------------------------------
# workers: one per engine, run in a subprocess, print one JSON line
def kvserve_runner(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """(kvserve's engine, its ``run_one(prompt_ids, new_tokens) -> (ttft_s, s_per_token)``)."""
    from kvserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory="3GiB", num_threads=args.threads, device=args.device,
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

    return eng, run_one


def worker_kvserve(args: argparse.Namespace) -> dict:
    eng, run_one = kvserve_runner(args)
    res = single_stream(run_one, args)
    if args.device != "cpu":  # the batch shapes' graphs, captured before the timed runs
        short = argparse.Namespace(**{**vars(args), "batch_new": 4})
        kvserve_batched(eng, short, args.batch)
        kvserve_batched(eng, short, max(1, args.batch // 2))
    res["batch_tok_s"], res["batch_decode_phase_tok_s"] = kvserve_batched(eng, args, args.batch)
    res["half_batch_decode_phase_tok_s"] = kvserve_batched(eng, args, max(1, args.batch // 2))[1]
    res["kv_bytes_per_token"] = eng.capacity.bytes_per_token
    graphs = getattr(eng.runner, "graphs", None)
    if graphs is not None:
        res["cuda_graphs"] = {"captured": graphs.captures, "replays": graphs.replays}
    from kvserve.native.choices import choices

    res["kernel_choices"] = [{"role": c.role, "band": c.band, "choice": c.choice, "source": c.source}
                             for c in choices()]
    return res


def kvserve_batched(eng, args: argparse.Namespace, b: int) -> tuple[float, float]:
    """B requests submitted at once (continuous batching, chunked prefill). Returns (generated
    tokens/s over the whole run, tokens/s of the decode phase: the tokens generated after every
    request has its first token, over that time, as ``llama_cpp_batched`` measures it)."""
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=args.batch_new, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    counts = {eng.add_request({"prompt_token_ids": prompt_ids(args.batch_prompt, 100 + i)}, params): 0
              for i in range(b)}
    t1, at_t1, live = None, 0, set(counts)
    while live:
        for out in eng.step():
            if out.request_id in counts:
                counts[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    live.discard(out.request_id)
        if t1 is None and all(counts.values()):
            t1, at_t1 = time.perf_counter(), sum(counts.values())
    t2 = time.perf_counter()
    total = sum(counts.values())
    return total / (t2 - t0), (total - at_t1) / (t2 - t1)


def worker_transformers(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(args.threads)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval().to(args.device)

    @torch.inference_mode()
    def run_one(ids: list[int], new: int) -> tuple[float, float]:
        cache = DynamicCache(config=model.config)
        sync(args.device)
        t0 = time.perf_counter()
        logits = model(torch.tensor([ids], device=args.device), past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits
        tok = logits[0, -1].argmax()
        sync(args.device)
        first = time.perf_counter()
        for _ in range(new - 1):
            logits = model(tok.view(1, 1), past_key_values=cache, use_cache=True).logits
            tok = logits[0, -1].argmax()
        sync(args.device)
        end = time.perf_counter()
        return first - t0, (end - first) / max(new - 1, 1)

    res = single_stream(run_one, args)
    with torch.inference_mode():
        batch = torch.tensor([prompt_ids(args.batch_prompt, 100 + i) for i in range(args.batch)], device=args.device)
        if args.device != "cpu":  # warm-up
            model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=4, do_sample=False,
                           pad_token_id=0)
        sync(args.device)
        t = time.perf_counter()
        out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.batch_new,
                             min_new_tokens=args.batch_new, do_sample=False, pad_token_id=0)
        sync(args.device)
        dt = time.perf_counter() - t
    res["batch_tok_s"] = (out.shape[1] - batch.shape[1]) * args.batch / dt
    return res


def llama_cpp_runner(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """(llama.cpp's ``Llama`` on the checkpoint's GGUF, its ``run_one`` as ``kvserve_runner``'s)."""
    import llama_cpp

    from benchmarks.llama_cpp_convert import to_gguf

    outtype = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[args.dtype]
    gguf = to_gguf(Path(args.model), CACHE / f"{Path(args.model).name}-{outtype}.gguf", outtype)
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=max(args.context + args.prefill) + args.decode_tokens + 8,
                          n_threads=args.threads, n_threads_batch=args.threads, n_batch=max(args.prefill),
                          n_ubatch=512, verbose=False)

    def run_one(ids: list[int], new: int) -> tuple[float, float]:
        llm.reset()
        t0 = time.perf_counter()
        first = None
        for n, _ in enumerate(llm.generate(ids, top_k=1, temp=0.0, reset=True), start=1):
            if first is None:
                first = time.perf_counter()
            if n == new:
                break
        end = time.perf_counter()
        return first - t0, (end - first) / max(new - 1, 1)

    return llm, run_one


def worker_llama_cpp(args: argparse.Namespace) -> dict:
    llm, run_one = llama_cpp_runner(args)
    res = single_stream(run_one, args)
    prompts = [prompt_ids(args.batch_prompt, 100 + i) for i in range(args.batch)]
    res["batch_tok_s"], res["batch_decode_phase_tok_s"] = llama_cpp_batched(llm, args, prompts)
    half = prompts[: max(1, args.batch // 2)]
    res["half_batch_decode_phase_tok_s"] = llama_cpp_batched(llm, args, half)[1]
    return res


def llama_cpp_batched(llm, args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, float]:
    """B sequences in one llama.cpp context through the low-level API (as llama-batched-bench does):
    prefill every prompt, then decode one token per sequence per llama_decode call. Returns
    (generated tokens/s over the whole run, tokens/s of the decode phase alone)."""
    import ctypes

    import llama_cpp as lc
    import numpy as np

    b, p, new = len(prompts), len(prompts[0]), args.batch_new
    params = lc.llama_context_default_params()
    params.n_ctx = b * (p + new) + 64
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = b
    params.n_threads = params.n_threads_batch = args.threads
    ctx = lc.llama_init_from_model(llm._model.model, params)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(llm._model.model))
    batch = lc.llama_batch_init(512, 0, b)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:  # (token, pos, seq, want logits)
        for start in range(0, len(items), 512):
            chunk = items[start:start + 512]
            batch.n_tokens = len(chunk)
            for i, (tok, pos, seq, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

    def argmax(i: int) -> int:
        ptr = lc.llama_get_logits_ith(ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)).argmax())

    t0 = time.perf_counter()
    last: list[int] = []
    for seq, ids in enumerate(prompts):  # one prompt per decode call: its last row holds its logits
        decode([(tok, pos, seq, pos == p - 1) for pos, tok in enumerate(ids)])
        last.append(argmax(-1))
    t1 = time.perf_counter()
    for step in range(new - 1):
        decode([(last[s], p + step, s, True) for s in range(b)])
        last = [argmax(s) for s in range(b)]
    t2 = time.perf_counter()
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    return b * new / (t2 - t0), b * (new - 1) / (t2 - t1)


WORKERS = {"kvserve": worker_kvserve, "transformers": worker_transformers, "llama.cpp": worker_llama_cpp,
           "kvserve-eager": worker_kvserve, "kvserve-copy": worker_kvserve, "kvserve-noamx": worker_kvserve}


def run_worker(engine: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", engine, "--model", str(args.model), "--dtype", args.dtype,
           "--threads", str(args.threads), "--repeats", str(args.repeats), "--device", args.device,
           "--batch", str(args.batch)]
    if args.quick:
        cmd.append("--quick")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if engine == "kvserve-eager":
        env["KVSERVE_CUDA_GRAPHS"] = "0"
    if engine == "kvserve-copy":
        env["KVSERVE_GEMM_EXTRA_MIB"] = COPY_MIB
    if engine == "kvserve-noamx":
        env["KVSERVE_TILED_AMX"] = "0"
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(lines[-1])


# --------------------------------------------------------------------------------------------
def report(doc: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    engines = [e for e in doc["engines"] if "error" not in doc["engines"][e]]
    where = f"on {doc['gpu']}" if doc.get("gpu") else f"{doc['threads']} threads"
    table = Table(title=f"Qwen2.5-0.5B shape, {doc['dtype']}, {where}; "
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
        row(f"  share, each run against its own probe @{n}",
            lambda d, n=n: d.get("bound_share_paired", {}).get(str(n), d.get("bound_share_paired", {}).get(n)), "{:.0%}")
    row(f"{doc['batch']} requests ({doc['batch_prompt']}+{doc['batch_new']}) tok/s", lambda d: d.get("batch_tok_s"))
    row("  decode phase only, tok/s", lambda d: d.get("batch_decode_phase_tok_s"))
    row(f"  {doc['batch'] // 2} requests, decode phase, tok/s", lambda d: d.get("half_batch_decode_phase_tok_s"))
    row("peak RSS (GiB)", lambda d: d["peak_rss_bytes"] / 2**30, "{:.2f}")
    if doc.get("gpu"):
        row("GPU peak allocated (GiB)", lambda d: d["gpu_peak_bytes"] / 2**30, "{:.2f}")
    console = Console(record=True, width=120, file=io.StringIO())
    if doc.get("cpu"):
        console.print(f"CPU: {doc['cpu']['model']}  flags: {' '.join(doc['cpu']['flags'])}")
    console.print(table)
    for name, r in doc.get("ratios", {}).items():
        console.print(f"{name}: {r:.2f}")
    return console.export_text()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                    help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (kvserve and transformers on the GPU)")
    ap.add_argument("--batch", type=int, default=None, help="concurrent requests (default 16; 4 with --quick)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="short prompts and decodes (smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "throughput.json")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.prefill = [128, 256] if args.quick else [512, 2048]
    args.context = [128, 256] if args.quick else [512, 2048]
    args.decode_tokens = 16 if args.quick else 64
    batch, args.batch_prompt, args.batch_new = (4, 64, 16) if args.quick else (16, 256, 128)
    args.batch = args.batch or batch
    global VOCAB
    if (args.model / "config.json").exists():
        VOCAB = min(VOCAB, json.loads((args.model / "config.json").read_text())["vocab_size"])

    if args.worker:
        res = WORKERS[args.worker](args)
        res["peak_rss_bytes"] = peak_rss_bytes()
        if args.device != "cpu":
            import torch

            res["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
        print(json.dumps(res))
        return

    from kvserve.bench.machine import cpu_info

    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {args.threads}", file=sys.stderr)
    gpu = None
    if args.device != "cpu":
        import torch

        gpu = torch.cuda.get_device_name()
        print(f"GPU: {gpu}  torch {torch.__version__}", file=sys.stderr)
    ensure_model(args.model, args.dtype)
    wbytes = weights_bytes(args.model)
    bw_start = measure_bandwidth(args.threads, device=args.device)
    results = {}
    for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
        if engine == "llama.cpp":
            if args.device != "cpu":
                results[engine] = {"error": ["llama.cpp runs on the CPU only here"]}
                continue
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                results[engine] = {"error": ["llama-cpp-python not installed (benchmarks/setup_llama_cpp.sh)"]}
                continue
        print(f"running {engine} ...", file=sys.stderr)
        results[engine] = run_worker(engine, args)
        print(f"{engine}: {json.dumps(results[engine])}", file=sys.stderr)  # kept if the run is stopped
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".partial.json").write_text(json.dumps(results, indent=1))
    bw = 0.5 * (bw_start + measure_bandwidth(args.threads, device=args.device))
    doc = {"cpu": cpu, "device": args.device, "gpu": gpu, "command": " ".join(["python", "benchmarks/throughput.py", *sys.argv[1:]]), "dtype": args.dtype, "threads": args.threads, "prefill": args.prefill, "context": args.context,
           "batch": args.batch, "batch_prompt": args.batch_prompt, "batch_new": args.batch_new,
           "weights_bytes": wbytes, "bandwidth_gb_s": bw, "bandwidth_gb_s_start": bw_start, "engines": results}
    kv_bpt = next((r.get("kv_bytes_per_token") for r in results.values() if r.get("kv_bytes_per_token")), 12288)
    for r in results.values():
        if "error" in r:
            continue
        r["bound_share"] = {}
        r["bound_share_paired"] = {}  # per decode run against its own probe, median over runs
        for n, tps in r["decode_tok_s"].items():
            step_bytes = wbytes + int(n) * kv_bpt
            r["bound_share"][n] = tps / (bw * 1e9 / step_bytes)
            probes = r.get("decode_probe_gb_s", {}).get(n) or r.get("decode_probe_gb_s", {}).get(str(n))
            runs = r["decode_ms_runs"].get(n) or r["decode_ms_runs"].get(str(n))
            if probes and runs:
                r["bound_share_paired"][n] = median([step_bytes / (ms * 1e-3) / (gb * 1e9) for ms, gb in zip(runs, probes)])
    ok = {e: r for e, r in results.items() if "error" not in r}
    ratios = {}
    if "kvserve" in ok:
        k = ok["kvserve"]
        for other in ("llama.cpp", "transformers", "kvserve-eager", "kvserve-copy", "kvserve-noamx"):
            if other in ok:
                o = ok[other]
                for n in k["decode_tok_s"]:
                    ratios[f"kvserve/{other} decode @{n}"] = k["decode_tok_s"][n] / o["decode_tok_s"][n]
                for n in k["prefill_tok_s"]:
                    ratios[f"kvserve/{other} prefill @{n}"] = k["prefill_tok_s"][n] / o["prefill_tok_s"][n]
                if o.get("batch_tok_s"):
                    ratios[f"kvserve/{other} batch"] = k["batch_tok_s"] / o["batch_tok_s"]
        if "llama.cpp" in ok:
            lc = ok["llama.cpp"]
            for key, label in (("batch_tok_s", "whole run"), ("batch_decode_phase_tok_s", "decode phase")):
                if k.get(key) and lc.get("half_batch_decode_phase_tok_s"):
                    ratios[f"kvserve {args.batch} requests ({label}) / llama.cpp batch of {args.batch // 2} decode"] = (
                        k[key] / lc["half_batch_decode_phase_tok_s"])
            if k.get("batch_decode_phase_tok_s") and lc.get("batch_decode_phase_tok_s"):
                ratios[f"kvserve/llama.cpp {args.batch} requests decode phase"] = (
                    k["batch_decode_phase_tok_s"] / lc["batch_decode_phase_tok_s"])
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
