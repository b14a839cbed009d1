"""Step time at tensor_parallel_size 1 against 2 on this CPU, and what one all-reduce costs.

T = 1 runs the model in one child process with ``--threads`` (default 2) threads; T = 2 runs two
worker processes of ``--threads // 2`` threads each (the same cores). Both go through the same
pipe to the engine, so the difference is the split itself: half the weights and heads per
process, plus two all-reduces of ``[tokens, hidden]`` per layer (after o_proj and down_proj).

Per configuration: the median runner step time (``runner.execute``, as the engine sees it) for
a prefill chunk of ``--prefill`` tokens and for decode steps of batch 1 and ``--batch``. A
separate two-process gloo loop times one all-reduce of ``[rows, hidden]`` in the model dtype.

    python -m benchmarks.tensor_parallel [--model DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.runner_overhead import cpu_info
from kvserve import LLM, SamplingParams
from kvserve.engine.llm import resolve_model_path

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


def measure(model: str, tp: int, threads: int, prefill: int, batch: int, decode: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    llm = LLM(model, kv_cache_memory="256MiB", runner="process", tensor_parallel_size=tp, num_threads=threads,
              max_num_batched_tokens=prefill, max_num_seqs=batch)
    start_s = time.perf_counter() - t0
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
    return {"tp": tp, "threads_per_worker": threads, "start_s": round(start_s, 2),
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
    args = ap.parse_args()
    model = resolve_model_path(args.model)
    from kvserve.model.loader import load_model_config

    cfg = load_model_config(model)
    rows = [1, args.batch, args.prefill]
    runs = [measure(model, 1, args.threads, args.prefill, args.batch, args.decode),
            measure(model, 2, max(1, args.threads // 2), args.prefill, args.batch, args.decode)]
    ar = allreduce_us(rows, cfg.hidden_size, cfg.dtype)
    result = {"cpu": cpu_info(), "model": model, "dtype": cfg.dtype, "layers": cfg.num_hidden_layers,
              "allreduces_per_step": 2 * cfg.num_hidden_layers, "allreduce_us_by_rows": ar, "runs": runs}
    print(f"cpu: {result['cpu']}")
    print(f"model {Path(model).name} ({cfg.dtype}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size})")
    keys = [k for k in runs[0] if k.endswith("_ms") or "_ms_" in k]
    print("| T | threads/worker | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for r in runs:
        print(f"| {r['tp']} | {r['threads_per_worker']} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")
    print(f"gloo all-reduce [rows, {cfg.hidden_size}] {cfg.dtype}, us by rows: {ar}; "
          f"{2 * cfg.num_hidden_layers} per step")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
