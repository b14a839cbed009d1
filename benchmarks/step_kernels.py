"""Where a CPU decode step's time goes: the fp16 GEMMs (one shard vs one per thread) and paged attention.

Two measurements behind docs/model-runtime.md and docs/benchmarks.md, on the Qwen2.5-0.5B shape
(24 layers, hidden 896, intermediate 4864, 14 query / 2 KV heads of 64), random bf16 weights:

* **GEMMs**: every projection of all 24 layers (distinct matrices, so the weights stream from
  memory as in a real step) plus the logits projection, as the runtime packs them
  (:class:`PackedFp16MLP` for gate/up/down, :class:`PackedFp16Linear` for qkv, o and the logits),
  with ``shards=1`` against ``shards=threads``, at 1, 16 and 256 rows;
* **paged attention**: one layer's ``paged_attention`` (write + gather + SDPA) for a single decode
  at 512, 2048 and 3520 context, 16 decodes at 384, a 65-token chunk over 3520 keys, and a
  512-token prefill; ×24 gives the per-step cost.

    python benchmarks/step_kernels.py              # ~3 min on 2 cores
    python benchmarks/step_kernels.py --threads 1

Both variants of each GEMM row count are timed alternately (median of ``--repeats``), so a drift
in the machine's bandwidth hits them alike. Prints a table and writes JSON
(default ``benchmarks/results/kernels.json``).

(Named step_kernels, not kernels: a module ``kernels`` in the script's folder shadowed the
``kernels`` package transformers imports, and broke throughput.py's transformers worker.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvserve.model.attention import AttentionMetadata, paged_attention
from kvserve.model.cpu_gemm import PackedFp16Linear, PackedFp16MLP

ROOT = Path(__file__).resolve().parent.parent
LAYERS, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 24, 896, 4864, 14, 2, 64, 151936
BLOCK = 16


def build_gemms(shards: int) -> list[torch.nn.Module]:
    g = torch.Generator().manual_seed(0)

    def w(o: int, i: int) -> torch.Tensor:
        return (torch.randn(o, i, generator=g) * 0.02).to(torch.bfloat16)

    mods: list[torch.nn.Module] = []
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    for _ in range(LAYERS):
        mods.append(PackedFp16Linear(w(qkv, HIDDEN), None, shards=shards))
        mods.append(PackedFp16Linear(w(HIDDEN, HEADS * HEAD_DIM), None, shards=shards))
        mods.append(PackedFp16MLP(w(2 * INTER, HIDDEN), w(HIDDEN, INTER), shards=shards))
    mods.append(PackedFp16Linear(w(VOCAB, HIDDEN), None, torch.float32, shards=shards))
    return mods


def time_gemms(mods: list[torch.nn.Module], rows: int) -> float:
    x = torch.randn(rows, HIDDEN).to(torch.bfloat16)
    t = time.perf_counter()
    for m in mods:
        m(x)
    return time.perf_counter() - t


def attention_case(q_lens: list[int], ctx_lens: list[int], cache: torch.Tensor):
    """A closure running one layer's paged_attention for sequences with these query/context lengths."""
    tables, slots, starts, base = [], [], [0], 0
    for ql, cl in zip(q_lens, ctx_lens, strict=True):
        n = -(-cl // BLOCK)
        table = torch.arange(base, base + n)
        base += n + 3                                   # not adjacent: a real pool is fragmented
        tables.append(table)
        slots += [int(table[p // BLOCK]) * BLOCK + p % BLOCK for p in range(cl - ql, cl)]
        starts.append(starts[-1] + ql)
    g = torch.Generator().manual_seed(1)
    t = starts[-1]
    q = torch.randn(t, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)

    def run() -> None:
        meta = AttentionMetadata(torch.tensor(slots), starts, list(ctx_lens), tables, BLOCK)
        paged_attention(q, k, v, cache, meta, HEAD_DIM ** -0.5)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kernels.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    doc: dict = {"threads": args.threads, "gemm_ms": {}, "attention_ms_per_layer": {}}

    variants = {"1 shard": build_gemms(1), f"{args.threads} shards": build_gemms(args.threads)}
    print(f"GEMMs of one 0.5B decode step (all 24 layers + logits), bf16 weights as fp16, {args.threads} threads")
    for rows in (1, 16, 256):
        reps = max(2, args.repeats // (3 if rows == 256 else 1))
        times: dict[str, list[float]] = {name: [] for name in variants}
        for name, mods in variants.items():
            time_gemms(mods, rows)                      # warm-up
        for _ in range(reps):
            for name, mods in variants.items():
                times[name].append(time_gemms(mods, rows))
        med = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
        doc["gemm_ms"][rows] = med
        one, many = med["1 shard"], med[f"{args.threads} shards"]
        print(f"  {rows:4d} rows: 1 shard {one:8.1f} ms   {args.threads} shards {many:8.1f} ms   speed-up {one / many:.2f}x")
    del variants

    cache = torch.randn(2, 1024, BLOCK, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    cases = {"decode, 1 seq @512": ([1], [512]), "decode, 1 seq @2048": ([1], [2048]),
             "decode, 1 seq @3520": ([1], [3520]), "decode, 16 seqs @384": ([1] * 16, [384] * 16),
             "chunk of 65 over 3520 keys": ([65], [3520]), "prefill of 512": ([512], [512])}
    print("paged_attention, one layer (×24 for a step)")
    for name, (q_lens, ctx_lens) in cases.items():
        run = attention_case(q_lens, ctx_lens, cache)
        run()
        n = 5 if max(q_lens) > 1 else 30
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            run()
            ts.append(time.perf_counter() - t)
        ms = 1e3 * statistics.median(ts)
        doc["attention_ms_per_layer"][name] = ms
        print(f"  {name:28s} {ms:7.2f} ms/layer   {24 * ms:7.1f} ms per step")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
