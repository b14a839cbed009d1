"""The native paged-attention kernel alone, per KV codec: its scalar and tiled paths and the torch
path, one layer of the Qwen2.5-0.5B attention shape (14 heads, 2 KV heads, head_dim 64, block 16).

Per codec (bf16 pool, int8 pool) and shape (sequences x context, new tokens), median µs of:

* ``write``: the layer's K/V write of the step (int8: the encode);
* ``scalar`` / ``tiled`` / ``kernel``: the kernel call alone (``attention_native.run_kernel``, IMPL 1 / 2 /
  0; ``kernel`` is what kvserve runs: on an int8 pool the int8-dot path where the build has
  AVX512-VNNI, else the bf16-dot path where it has AVX512-BF16, else the tiled one);
* ``no_int8dot``: the kernel with the int8-dot path off (IMPL 3: the bf16-dot path on the int8
  pool; on a bf16 pool the same as ``kernel``), timed alternately with ``kernel``;
* ``no_amx``: where the bf16-dot path's products run on AMX tiles (``amx_available()``), the kernel
  with them on ``vdpbf16ps`` instead (IMPL 4), timed alternately with ``kernel``;
* ``torch``: the torch path's read (gather/decode + SDPA, ``attention.attend_written``);
* with ``--rev REV``: ``kernel@REV``, the kernel as it was at git revision REV, built beside the
  working tree's (``benchmarks/revision_build.py``) and timed alternately with ``kernel``, so the
  two columns share the host's drift (their ratio is the A/B);
* with ``--q-tiles 4,8,16,32``: ``q_tileN``, the kernel with ``attention_native.Q_TILE`` = N (query
  tokens per task), the tiles timed alternately;
* with ``--pool-pages``: ``kernel_4k``, the kernel on a copy of the case whose pool is on 4 KiB
  pages (kvserve's pool is on transparent huge pages where it may be,
  ``kvserve.model.huge_pages``), timed alternately with ``kernel``.

    PYTHONPATH=$PWD python benchmarks/paged_kernel.py            # ~1 min
    PYTHONPATH=$PWD python benchmarks/paged_kernel.py --codecs bf16 --shapes 16x2048+1
    PYTHONPATH=$PWD python benchmarks/paged_kernel.py --codecs bf16 --heads 8 --kv-heads 2 --head-dim 32  # embedded
    PYTHONPATH=$PWD python benchmarks/paged_kernel.py --rev HEAD --shapes 16x2048+1,1x2048+1  # A/B
    PYTHONPATH=$PWD python benchmarks/paged_kernel.py --pool-pages --codecs bf16 --shapes 16x2048+1,64x2048+1

Synthetic K/V (unit normal) in shuffled blocks; timing does not depend on the values. Prints a
table and writes JSON (default ``benchmarks/results/paged_kernel.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve.kv import storage as storage_mod
from kvserve.kv.quant import parse_kv_codecs
from kvserve.kv.storage import KVStorage
from kvserve.model import attention, attention_native
from kvserve.model.attention import AttentionMetadata

H, KVH, D, BS = 14, 2, 64, 16
SHAPES = "1x512+1,1x2048+1,16x512+1,16x2048+1,1x3520+65,1x384+256"


def median_us(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def case(codec: str, seqs: int, ctx: int, new: int, dtype: torch.dtype, small_pages: bool = False) -> dict[str, Any]:
    """A one-layer pool holding ``seqs`` contexts of ``ctx`` tokens, the last ``new`` of them
    this step's (written by the step, as in serving); ``small_pages``: the pool on 4 KiB pages."""
    nb = -(-ctx // BS)
    g = torch.Generator().manual_seed(0)
    real_empty_on = storage_mod.empty_on
    if small_pages:
        storage_mod.empty_on = lambda device, shape, dt: torch.empty(shape, dtype=dt, device=device)
    try:
        s = KVStorage(num_layers=1, num_blocks=seqs * nb, block_size=BS, kv_heads=KVH, head_dim=D, dtype=dtype,
                      pool=parse_kv_codecs(codec, "bfloat16"), group_size=BS)
    finally:
        storage_mod.empty_on = real_empty_on
    perm = torch.randperm(seqs * nb, generator=g)
    tables = [perm[i * nb:(i + 1) * nb] for i in range(seqs)]

    def slots(a: int, b: int) -> torch.Tensor:
        return torch.cat([t[p // BS:p // BS + 1] * BS + p % BS for t in tables for p in range(a, b)])

    def begin(a: int, b: int) -> None:
        s.begin_step([SimpleNamespace(start=a, end=b, block_ids=tuple(int(x) for x in t)) for t in tables],
                     [None] * seqs)

    if ctx > new:
        begin(0, ctx - new)
        n = seqs * (ctx - new)
        s.layers()[0].write(torch.randn(n, KVH, D, generator=g).to(dtype), torch.randn(n, KVH, D, generator=g).to(dtype),
                            slots(0, ctx - new))
        s.end_step()
    begin(ctx - new, ctx)
    meta = AttentionMetadata(slots(ctx - new, ctx), [i * new for i in range(seqs + 1)], [ctx] * seqs, tables, BS)
    kv = torch.randn(seqs * new, KVH, D, generator=g).to(dtype)
    q = torch.randn(seqs * new, H, D, generator=g).to(dtype)
    layer = s.layers()[0]
    layer.write(kv, kv, meta.slot_mapping)
    return {"storage": s, "layer": layer, "meta": meta, "q": q, "kv": kv}


def alternating_us(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median µs of each function, the functions called in turn ``repeats`` times."""
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e6 for k, v in ts.items()}


def measure(codec: str, shape: str, repeats: int, dtype: torch.dtype, old: tuple[str, Any] | None = None,
            pool_pages: bool = False, q_tiles: tuple[int, ...] = ()) -> dict[str, float]:
    seqs, rest = shape.split("x")
    ctx, new = (int(x) for x in rest.split("+"))
    c = case(codec, int(seqs), ctx, new, dtype)
    mod = attention_native.native_module()
    layer, meta, q = c["layer"], c["meta"], c["q"]
    src = attention_native.kv_source(layer)
    plan = attention_native.plan_native(meta)
    out = torch.empty_like(q)
    res = {"write": median_us(lambda: layer.write(c["kv"], c["kv"], meta.slot_mapping), repeats)}
    if mod is not None and src is not None:
        for name, impl in (("scalar", 1), ("tiled", 2)):
            attention_native.IMPL = impl
            res[name] = median_us(lambda: attention_native.run_kernel(mod, q, out, plan, src, BS, KVH, D ** -0.5),
                                  repeats)

        def with_impl(impl: int) -> Callable[[], None]:
            def run() -> None:
                attention_native.IMPL = impl
                attention_native.run_kernel(mod, q, out, plan, src, BS, KVH, D ** -0.5)
            return run
        amx = getattr(mod, "amx_available", lambda: False)()
        res.update(alternating_us({"kernel": with_impl(0), "no_int8dot": with_impl(3),
                                   **({"no_amx": with_impl(4)} if amx else {})}, repeats))
        attention_native.IMPL = 0
        if old is not None:
            res.update(alternating_us({
                "kernel": lambda: attention_native.run_kernel(mod, q, out, plan, src, BS, KVH, D ** -0.5),
                f"kernel@{old[0]}": lambda: attention_native.run_kernel(old[1], q, out, plan, src, BS, KVH, D ** -0.5)},
                2 * repeats + 1))
        if q_tiles:
            def with_tile(t: int) -> Callable[[], None]:
                def run() -> None:
                    attention_native.Q_TILE = t
                    attention_native.run_kernel(mod, q, out, plan, src, BS, KVH, D ** -0.5)
                return run
            default_tile = attention_native.Q_TILE
            res.update(alternating_us({f"q_tile{t}": with_tile(t) for t in q_tiles}, 2 * repeats + 1))
            attention_native.Q_TILE = default_tile
        if pool_pages:
            c4 = case(codec, int(seqs), ctx, new, dtype, small_pages=True)
            src4, q4, out4 = attention_native.kv_source(c4["layer"]), c4["q"], torch.empty_like(q)
            res.update(alternating_us({
                "kernel": lambda: attention_native.run_kernel(mod, q, out, plan, src, BS, KVH, D ** -0.5),
                "kernel_4k": lambda: attention_native.run_kernel(mod, q4, out4, plan, src4, BS, KVH, D ** -0.5)},
                2 * repeats + 1))
            c4["storage"].end_step()
    tplan = attention.plan_step(meta, layer.shape, q.device)
    res["torch"] = median_us(lambda: attention.attend_written(q, layer, meta, tplan, D ** -0.5, out), repeats)
    c["storage"].end_step()
    return res


def main(argv: list[str] | None = None) -> None:
    global H, KVH, D
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", default="bf16;int8", help="';'-separated KV codecs")
    ap.add_argument("--shapes", default=SHAPES, help="SEQSxCONTEXT+NEW, comma-separated")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--heads", type=int, default=H)
    ap.add_argument("--kv-heads", type=int, default=KVH)
    ap.add_argument("--head-dim", type=int, default=D)
    ap.add_argument("--rev", help="also time the kernel as it was at this git revision (A/B)")
    ap.add_argument("--pool-pages", action="store_true",
                    help="also time the kernel on a pool on 4 KiB pages (kernel_4k), alternately with kernel")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "paged_kernel.json")
    ap.add_argument("--q-tiles", default="", help="also time the kernel at these query tiles (e.g. 4,8,16,32: "
                    "attention_native.Q_TILE, alternating; columns q_tileN)")
    a = ap.parse_args(argv)
    q_tiles = tuple(int(t) for t in a.q_tiles.split(",") if t.strip())
    H, KVH, D = a.heads, a.kv_heads, a.head_dim
    from kvserve.bench.machine import cpu_info

    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {torch.get_num_threads()}")
    codecs = [c.strip() for c in a.codecs.split(";") if c.strip()]
    old = None
    if a.rev:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from revision_build import build_revision

        old = (a.rev, build_revision(a.rev, "kvserve/native/csrc/paged_attention.cpp"))
    results: dict[str, dict[str, dict[str, float]]] = {}
    rev_col = (f"  kernel@{a.rev}" if a.rev else "") + ("  kernel_4k" if a.pool_pages else "") + \
        "".join(f"  {'q_tile' + str(t):>9}" for t in q_tiles)
    print(f"{'codec':<6} {'shape':<12} {'write':>8} {'scalar':>9} {'tiled':>9} {'kernel':>9} {'no_i8dot':>9} {'no_amx':>9} {'torch':>9}{rev_col}   (µs; "
          f"{H} heads, {KVH} KV heads, head_dim {D})")
    for codec in codecs:
        results[codec] = {}
        for shape in a.shapes.split(","):
            r = measure(codec, shape, a.repeats, torch.bfloat16, old, a.pool_pages, q_tiles)
            results[codec][shape] = r
            print(f"{codec:<6} {shape:<12} {r['write']:>8.0f} {r.get('scalar', float('nan')):>9.0f} "
                  f"{r.get('tiled', float('nan')):>9.0f} {r.get('kernel', float('nan')):>9.0f} "
                  f"{r.get('no_int8dot', float('nan')):>9.0f} {r.get('no_amx', float('nan')):>9.0f} {r['torch']:>9.0f}"
                  + (f"  {r.get(f'kernel@{a.rev}', float('nan')):>9.0f}" if a.rev else "")
                  + (f"  {r.get('kernel_4k', float('nan')):>9.0f}" if a.pool_pages else "")
                  + "".join(f"  {r.get(f'q_tile{t}', float('nan')):>9.0f}" for t in q_tiles),
                  flush=True)
    doc = {"cpu": cpu, "threads": torch.get_num_threads(), "command": " ".join(sys.argv), "shape": {"heads": H, "kv_heads": KVH, "head_dim": D,
           "block_size": BS, "dtype": "bfloat16"}, "results": results}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
