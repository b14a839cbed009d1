"""Step time at tensor_parallel_size 1 against 2 on this CPU, and what one all-reduce costs.

T = 1 runs the model in one child process with ``--threads`` (default 2) threads; T = 2 runs two
worker processes of ``--threads // 2`` threads each (the same cores). Both go through the same
pipe to the engine, so the difference is the split itself: half the weights and heads per
process, plus two all-reduces of ``[tokens, hidden]`` per layer (after o_proj and down_proj).

Per configuration: the median runner step time (``runner.execute``, as the engine sees it) for
a prefill chunk of ``--prefill`` tokens and for decode steps of batch 1 and ``--batch``. T = 2
runs twice: with the shared-memory all-reduce (the default on CPU) and with gloo's
(``KVSERVE_TP_ALLREDUCE=gloo``). A separate two-process loop times one all-reduce of
``[rows, hidden]`` in the model dtype, on each.

    python -m benchmarks.tensor_parallel [--model DIR] [--json FILE] [--parts ...] [--merge]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.runner_overhead import cpu_info
from kvserve import LLM, SamplingParams
from kvserve.engine.llm import resolve_model_path
from kvserve.native import choices as kernel_choices
from kvserve.parallel import shm_allreduce

DEFAULT_MODEL = Path(__file__).resolve().parent / ".cache" / "qwen2.5-0.5b"


def _timed_steps(llm: LLM) -> list[tuple[int, int, float]]:
    """Wrap the runner: every step's (sequences, tokens, seconds)."""
    runner, log = llm.engine.runner, []
    execute = runner.execute

    def timed(out: Any) -> Any:
        t0 = time.perf_counter()
        result = execute(out)
        if out.chunks:
            log.append((len(out.chunks), sum(c.num_new_tokens for c in out.chunks), time.perf_counter() - t0))
        return result

    runner.execute = timed
    return log


def _kernels(llm: LLM) -> list[dict[str, str]]:
    """What every rank runs: ``{role/band: choice}`` per rank (T = 1: the runner process's)."""
    runner = llm.engine.runner
    per_rank = getattr(runner, "worker_kernel_choices", None) or [kernel_choices.choices()]
    return [{f"{c.role}/{c.band}": c.choice for c in rank} for rank in per_rank]


def measure(model: str, tp: int, threads: int, prefill: int, batch: int, decode: int,
            allreduce: str = "auto") -> dict[str, Any]:
    os.environ[shm_allreduce.ENV] = allreduce  # the workers inherit it
    kernel_choices.clear()
    t0 = time.perf_counter()
    llm = LLM(model, kv_cache_memory="256MiB", runner="process", tensor_parallel_size=tp, num_threads=threads,
              max_num_batched_tokens=prefill, max_num_seqs=batch)
    start_s = time.perf_counter() - t0
    kernels = _kernels(llm)
    log = _timed_steps(llm)
    params = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(97 * i + 13 * j) % 30000 + 100 for i in range(prefill)]} for j in range(2)]
    llm.generate(prompts[0], params)                                     # warm-up
    log.clear()
    llm.generate(prompts[1], params)
    one = [s for n, t, s in log if n == 1 and t == 1]
    pre = [s for n, t, s in log if t == prefill]
    log.clear()
    llm.generate([{"prompt_token_ids": [(31 * i + 7 * j) % 30000 + 100 for i in range(16)]} for j in range(batch)],
                 params)
    many = [s for n, t, s in log if n == batch and t == batch]
    llm.shutdown()
    return {"tp": tp, "threads_per_worker": threads, "allreduce": kernels[0].get("tp_allreduce/all", "-"),
            "start_s": round(start_s, 2), "kernels_by_rank": kernels,
            "prefill_step_ms": round(statistics.median(pre) * 1e3, 2),
            "decode_step_ms_batch1": round(statistics.median(one) * 1e3, 2),
            f"decode_step_ms_batch{batch}": round(statistics.median(many) * 1e3, 2)}


def _allreduce_rank(rank: int, store: str, rows: list[int], hidden: int, dtype: str, impl: str, out: str) -> None:
    import torch.distributed as dist

    from kvserve.parallel import shm_allreduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    reduce = dist.all_reduce
    if impl == "shm":
        shm, why = shm_allreduce.join(rank, 2)
        if shm is None:
            raise RuntimeError(f"no shared-memory all-reduce here: {why}")
        reduce = shm
    times = {}
    for r in rows:
        x = torch.zeros(r, hidden, dtype=getattr(torch, dtype))
        n = 100 if impl == "gloo" else 2000
        for _ in range(n // 10):
            reduce(x)
        t0 = time.perf_counter()
        for _ in range(n):
            reduce(x)
        times[r] = (time.perf_counter() - t0) / n * 1e6
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def allreduce_us(rows: list[int], hidden: int, dtype: str, impl: str) -> dict[str, float]:
    """Microseconds per all-reduce of ``[rows, hidden]`` between two processes (``impl``: gloo or shm)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_allreduce_rank, args=(f"{d}/store", rows, hidden, dtype, impl, f"{d}/out.json"), nprocs=2)
        return {str(k): round(v, 1) for k, v in json.loads(Path(f"{d}/out.json").read_text()).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL) if DEFAULT_MODEL.exists() else None)
    ap.add_argument("--threads", type=int, default=2, help="cores used in both configurations")
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--decode", type=int, default=24)
    ap.add_argument("--json", default=None)
    ap.add_argument("--parts", nargs="+", default=["collective", "t1", "t2", "t2-gloo"],
                    choices=["collective", "t1", "t2", "t2-gloo"],
                    help="what to measure: the collective alone, T=1, T=2 (shared-memory sum), T=2 on gloo")
    ap.add_argument("--merge", action="store_true", help="add to --json's earlier parts instead of replacing them")
    args = ap.parse_args()
    model = resolve_model_path(args.model)
    from kvserve.model.loader import load_model_config

    cfg = load_model_config(model)
    rows = [1, args.batch, args.prefill]
    result: dict[str, Any] = {"cpu": cpu_info(), "model": model, "dtype": cfg.dtype, "layers": cfg.num_hidden_layers,
                              "allreduces_per_step": 2 * cfg.num_hidden_layers}
    if "collective" in args.parts:
        result["allreduce_us_by_rows"] = {impl: allreduce_us(rows, cfg.hidden_size, cfg.dtype, impl)
                                          for impl in ("shm", "gloo")}
    configs = {"t1": (1, args.threads, "auto"), "t2": (2, max(1, args.threads // 2), "shm"),
               "t2-gloo": (2, max(1, args.threads // 2), "gloo")}
    result["runs"] = [measure(model, *configs[p][:2], args.prefill, args.batch, args.decode, configs[p][2])
                      for p in args.parts if p in configs]
    print(f"cpu: {result['cpu']}")
    print(f"model {Path(model).name} ({cfg.dtype}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size})")
    runs = result["runs"]
    if runs:
        keys = [k for k in runs[0] if k.endswith("_ms") or "_ms_" in k]
        print("| T | threads/worker | all-reduce | " + " | ".join(keys) + " |")
        print("|---|---|---|" + "---|" * len(keys))
        for r in runs:
            print(f"| {r['tp']} | {r['threads_per_worker']} | {r['allreduce']} | "
                  + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")
    for impl, us in result.get("allreduce_us_by_rows", {}).items():
        print(f"{impl} all-reduce [rows, {cfg.hidden_size}] {cfg.dtype}, us by rows: {us}; "
              f"{2 * cfg.num_hidden_layers} per step")
    if args.json:
        path = Path(args.json)
        old = json.loads(path.read_text()) if args.merge and path.exists() else {}
        if "runs" in old:  # a part measured now replaces the same part of an earlier run
            mine = {(r["tp"], r["allreduce"]) for r in runs}
            result["runs"] = [r for r in old["runs"] if (r["tp"], r.get("allreduce", "gloo")) not in mine] + runs
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**old, **result}, indent=2))


if __name__ == "__main__":
    main()
