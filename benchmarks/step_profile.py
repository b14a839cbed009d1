"""Where one decode step's time goes on the 0.5B shape: the model's ops, and the engine's own
bookkeeping around them.

    python benchmarks/step_profile.py                       # bf16, 2 threads, 512-token context
    python benchmarks/step_profile.py --batch 16 --steps 16

Two measurements, same engine, decode phase only:

* **split**: wall time of ``LLMEngine.step`` against the time inside the model's forward, the
  logits projection and the sampler (timers wrapped around those three calls). Bookkeeping =
  step - forward - logits - sampling: scheduling, the runner's input tensors, output processing,
  detokenising. Issue 14's target: under 2% of the step.
* **modules**: time inside each kind of module (forward hooks: the MLPs, qkv/o projections,
  attention, norms, summed over layers; the logits projection), which sees the native kernels;
  hooks keep the per-layer path (not the native layer loop of kvserve/model/decode_stack.py), so
  these times include the Python around each module that the split's steps do not pay;
* **ops**: ``torch.profiler`` over a few decode steps: self CPU time per op per step, top ops
  (it cannot see into the native kernels or FBGEMM's pool threads).

Prints both and writes JSON (default ``benchmarks/results/step_profile.json``), with the CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve import LLM, SamplingParams
from kvserve.bench.machine import cpu_info
from kvserve.model import decode_stack
from kvserve.native.choices import choices

ROOT = Path(__file__).resolve().parents[1]


def timed(fn: Callable[..., Any], sink: list[float]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            sink.append(time.perf_counter() - t0)
    return wrapper


def module_times(eng: Any, model: Any, steps: int) -> dict[str, float]:
    """ms per step inside each kind of module (forward hooks; a layer's submodules summed over the
    layers, keyed by their name inside a layer, e.g. ``mlp``, ``self_attn.qkv_proj``; the logits
    projection as ``lm_head``). Native kernels (the tiled GEMM, FBGEMM's pool shards, the paged
    attention) show here, where the op profiler cannot see into them."""
    import collections

    acc: dict[str, float] = collections.defaultdict(float)
    starts: dict[str, float] = {}
    handles = []
    for name, mod in model.named_modules():
        parts = name.split(".")
        key = ".".join(parts[3:]) if len(parts) > 3 and parts[1] == "layers" else name
        if key.split(".")[-1] in ("qkv_proj", "o_proj", "mlp", "self_attn", "input_layernorm",
                                  "post_attention_layernorm", "lm_head", "embed_tokens"):
            handles.append(mod.register_forward_pre_hook(lambda m, i, k=key: starts.__setitem__(k, time.perf_counter())))
            handles.append(mod.register_forward_hook(
                lambda m, i, o, k=key: acc.__setitem__(k, acc[k] + time.perf_counter() - starts[k])))
    decode_stack.forget(model)  # hooked modules: the per-layer path (the native loop would skip them)
    try:
        for _ in range(steps):
            eng.step()
    finally:
        for h in handles:
            h.remove()
        decode_stack.forget(model)
    return {k: v * 1e3 / steps for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "benchmarks" / ".cache" / "qwen2.5-0.5b"))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "step_profile.json"))
    args = ap.parse_args()
    info = cpu_info()
    print(f"CPU: {info['model']}  flags: {' '.join(info['flags'])}  threads: {args.threads}")
    llm = LLM(args.model, dtype="bfloat16", kv_cache_memory="1GiB", num_threads=args.threads)
    eng, runner = llm.engine, llm.engine.runner
    sinks: dict[str, list[float]] = {k: [] for k in ("step", "forward", "logits", "sample")}
    runner.model.forward = timed(runner.model.forward, sinks["forward"])
    runner.model.compute_logits = timed(runner.model.compute_logits, sinks["logits"])
    runner.sampler.sample = timed(runner.sampler.sample, sinks["sample"])
    total = 2 * args.steps + args.profile_steps + 2  # split, modules, profile
    params = SamplingParams(max_tokens=total + 4, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request({"prompt_token_ids": [10 + (j * 7 + i) % 3000 for j in range(args.context)]}, params)
    rows: list[int] = []
    forward = runner.model.forward
    runner.model.forward = lambda ids, *a, **k: (rows.append(int(ids.shape[0])), forward(ids, *a, **k))[1]
    while not rows or rows[-1] != args.batch:  # prefill (maybe chunked) until the first decode step
        eng.step()
    eng.step()  # warm
    runner.model.forward = forward
    for sink in sinks.values():
        sink.clear()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        eng.step()
        sinks["step"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in sinks.items()}
    per_step = {k: sum(v) / len(sinks["step"]) * 1e3 for k, v in sinks.items()}
    book = per_step["step"] - per_step["forward"] - per_step["logits"] - per_step["sample"]
    print(f"\ndecode step, batch {args.batch}, context {args.context}: {len(sinks['step'])} steps")
    print(f"{'part':>12} {'ms/step (mean)':>15} {'median ms':>10} {'share':>7}")
    for k in ("step", "forward", "logits", "sample"):
        print(f"{k:>12} {per_step[k]:>15.3f} {med[k]:>10.3f} {per_step[k] / per_step['step']:>7.1%}")
    print(f"{'bookkeeping':>12} {book:>15.3f} {'':>10} {book / per_step['step']:>7.1%}")

    modules = module_times(eng, runner.model, args.steps)
    print(f"\ntime inside modules (forward hooks), ms/step over {args.steps} steps")
    for k, v in modules.items():
        print(f"{k:>44} {v:>10.3f}")

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile_steps):
            eng.step()
    ops = []
    for e in prof.key_averages():
        ops.append({"op": e.key, "calls_per_step": e.count / args.profile_steps,
                     "self_ms_per_step": e.self_cpu_time_total / 1e3 / args.profile_steps})
    ops.sort(key=lambda r: -r["self_ms_per_step"])
    profiled_ms = sum(r["self_ms_per_step"] for r in ops)
    print(f"\ntop ops by self CPU time (profiler on: {profiled_ms:.1f} ms/step of self time)")
    print(f"{'op':>44} {'calls/step':>10} {'self ms/step':>12}")
    for r in ops[: args.top]:
        print(f"{r['op'][:44]:>44} {r['calls_per_step']:>10.0f} {r['self_ms_per_step']:>12.3f}")
    eng.run_until_done()
    out = {"cpu": info, "torch": torch.__version__, "threads": args.threads, "batch": args.batch,
           "context": args.context, "steps": args.steps, "ms_per_step": per_step, "median_ms": med,
           "bookkeeping_ms": book, "bookkeeping_share": book / per_step["step"], "modules_ms_per_step": modules,
           "ops": ops[:40],
           "kernel_choices": [vars(c) for c in choices()]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
