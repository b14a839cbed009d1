"""Where a CUDA decode step's time goes: the whole engine step (scheduling, inputs, the graph,
sampling, outputs) against the captured graph's replay alone (the GPU's share), per batch and
context, for each captured attention variant (``kvserve.model.attention_static.VARIANTS``), and a
prompt's prefill step: its wall time against the GPU's busy time (torch.profiler).

    python benchmarks/cuda_step_profile.py                       # 0.5B shape, bf16, ~1 min on an H200
    python benchmarks/cuda_step_profile.py --batches 1,16,64 --contexts 512,2048 --variants sdpa,matmul

Each (variant, batch, context): ``batch`` requests with ``context``-token prompts are prefilled,
then ``--steps`` decode steps are timed one by one (``torch.cuda.synchronize`` around each), then
the graph those steps replayed is replayed alone as many times (it rewrites the same K/V at the same
slots: the same values). ``host`` is step minus replay: the engine's Python per step. Prints a
table and writes JSON (default benchmarks/results/cuda_step_profile.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.throughput import CACHE, ensure_model, prompt_ids


def timed(fn, n: int) -> float:
    """Median ms of ``n`` calls of ``fn``, each between two synchronizations."""
    import torch

    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def profile(eng, variant: str, batch: int, ctx: int, steps: int) -> dict:
    from kvserve import SamplingParams
    from kvserve.runner.decode_graphs import MIN_BLOCKS, DecodeGraphs, bucket

    runner = eng.runner
    runner.graphs = DecodeGraphs(runner.model, runner.capacity.block_size, runner.config.sliding_window,
                                 runner.device, bucket(runner.capacity.num_blocks, MIN_BLOCKS), attention=variant)
    params = SamplingParams(max_tokens=2 * steps + 16, temperature=0, ignore_eos=True)
    ids = [eng.add_request({"prompt_token_ids": prompt_ids(ctx, 50 + i)}, params) for i in range(batch)]
    counts = dict.fromkeys(ids, 0)
    while min(counts.values()) < 4:  # prefilled, and the decode graph captured
        for out in eng.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
    before = {k: e.replays for k, e in runner.graphs.entries.items()}
    step_ms = timed(eng.step, steps)
    used = max(runner.graphs.entries, key=lambda k: runner.graphs.entries[k].replays - before.get(k, 0))
    replay_ms = timed(runner.graphs.entries[used].graph.replay, steps)
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return {"variant": variant, "batch": batch, "context": ctx, "bucket": list(used), "step_ms": step_ms,
            "replay_ms": replay_ms, "host_ms": step_ms - replay_ms}


def prefill_profile(eng, ctx: int, repeats: int) -> dict:
    """One ``ctx``-token prompt prefilled in one step (1 token out), ``repeats`` times: the median
    wall time of that step, and of one profiled step the GPU's busy time (the sum of its kernels'
    own device time, torch.profiler) and the host's part of the step (wall minus busy)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def one(seed: int) -> None:
        eng.add_request({"prompt_token_ids": prompt_ids(ctx, seed)}, params)
        while eng.has_unfinished_requests():
            eng.step()

    one(1)  # warm-up at this shape
    wall = timed(lambda: one(2), repeats)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one(3)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]  # the GPU's own events
    busy = sum(e.self_device_time_total for e in kernels) / 1e3  # µs -> ms
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:6]
    return {"context": ctx, "wall_ms": wall, "gpu_busy_ms": busy, "host_ms": wall - busy,
            "top_kernels": [(e.key[:60], e.self_device_time_total / 1e3, e.count) for e in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--variants", default="sdpa,matmul", help="comma-separated; auto, sdpa, matmul")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cuda_step_profile.json")
    args = ap.parse_args()
    import torch

    from kvserve import LLM
    from kvserve.bench.machine import cpu_info

    cpu = cpu_info()
    gpu = torch.cuda.get_device_name()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}\nGPU: {gpu}  torch {torch.__version__}")
    ensure_model(args.model, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    llm = LLM(args.model, dtype=args.dtype, device="cuda", kv_cache_memory="8GiB", max_num_seqs=max(batches),
              max_num_batched_tokens=4096, enable_prefix_caching=False)
    rows = []
    for variant in args.variants.split(","):
        for b in batches:
            for c in contexts:
                rows.append(profile(llm.engine, variant, b, c, args.steps))
                r = rows[-1]
                print(f"{variant:7s} batch {b:3d} ctx {c:5d} bucket {r['bucket']}: step {r['step_ms']:.2f} ms, "
                      f"replay {r['replay_ms']:.2f} ms, host {r['host_ms']:.2f} ms", flush=True)
    prefill = []
    for c in contexts:
        try:
            prefill.append(prefill_profile(llm.engine, c, 5))
        except Exception as e:  # noqa: BLE001 - the decode rows above are kept
            print(f"prefill {c}: profiling failed: {e!r}")
            continue
        p = prefill[-1]
        print(f"prefill {c:5d}: step {p['wall_ms']:.2f} ms, GPU busy {p['gpu_busy_ms']:.2f} ms, "
              f"host {p['host_ms']:.2f} ms; top kernels {p['top_kernels']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": cpu, "gpu": gpu, "torch": torch.__version__, "dtype": args.dtype,
                                    "command": " ".join(["python", "benchmarks/cuda_step_profile.py", *sys.argv[1:]]),
                                    "rows": rows, "prefill": prefill}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
