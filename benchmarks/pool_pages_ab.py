"""Decode steps with the KV pool on transparent huge pages against the same on 4 KiB pages, one run.

kvserve allocates its CPU KV pool with ``kvserve.model.huge_pages.empty_on`` (huge pages where THP
allows). On the 0.5B shape one block's side of one KV head is 2 KiB and a sequence's blocks are
scattered through the pool, so on 4 KiB pages almost every block the attention kernel reads is a
TLB miss (a nested page walk in a VM). Two engines on the random-weight Qwen2.5-0.5B-shaped
checkpoint, one with its pool on huge pages (kvserve's default) and one with it on 4 KiB pages
(``empty_on`` replaced by ``torch.empty`` while it is built), their ``--batch`` sequences filled to
each context with random K/V (``kv_quant.py --fill synthetic``), then decode steps round-robin. Per
context: each engine's median step and the paired ratio (each round's huge-page step against the
4 KiB step of the same round: median, 95 % interval, share of rounds faster).

    PYTHONPATH=$PWD python benchmarks/pool_pages_ab.py --batch 16 --contexts 2048 --steps 48

Prints a table and writes JSON (default ``benchmarks/results/pool_pages_ab.json``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kv_quant import CACHE, ensure_model, make_engines, paired_ratio, paired_text, run_all

from kvserve.bench.results import write_json
from kvserve.kv import storage as storage_mod
from kvserve.model import huge_pages


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--codec", default="bf16", help="the pool's KV codec (both engines)")
    ap.add_argument("--contexts", default="2048")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=48, help="decode steps per engine per context")
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes per engine")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "pool_pages_ab.json")
    a = ap.parse_args(argv)
    from kvserve.bench.machine import cpu_info

    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  THP: {huge_pages.thp_mode()}", file=sys.stderr)
    if not huge_pages.enabled():
        sys.exit("huge pages are not available here (THP never/absent, or KVSERVE_HUGE_PAGES=0): nothing to compare")
    contexts = [int(c) for c in a.contexts.split(",")]
    model = ensure_model(a.model)
    t0 = time.time()
    args = (model, [a.codec], contexts, a.batch, a.steps, a.kv_cache_memory, a.threads)
    huge = make_engines(*args)[a.codec]
    real = storage_mod.empty_on
    storage_mod.empty_on = lambda device, shape, dtype: torch.empty(shape, dtype=dtype, device=device)
    try:
        small = make_engines(*args)[a.codec]
    finally:
        storage_mod.empty_on = real
    assert all(b.data_ptr() % huge_pages.HUGE_PAGE == 0 for b in huge.runner.storage._bufs)
    res = run_all({"huge": huge, "4k": small}, contexts, a.batch, a.steps, synthetic=True)
    rows = {}
    print(f"{'context':>8} {'huge ms':>9} {'4k ms':>9} {'huge/4k paired (95% CI)':>26} {'faster':>7}")
    for c in contexts:
        h, s = res["huge"]["contexts"][str(c)], res["4k"]["contexts"][str(c)]  # type: ignore[index]
        p = paired_ratio(h["step_samples_ms"], s["step_samples_ms"])
        rows[str(c)] = {"huge_step_ms": h["step_ms"], "small_step_ms": s["step_ms"], "paired_huge_vs_4k": p}
        print(f"{c:>8} {h['step_ms']:>9.1f} {s['step_ms']:>9.1f} {paired_text(p):>26} {p['faster_share']:>7.0%}")
    write_json(a.json, {"model": str(model), "cpu": cpu, "thp": huge_pages.thp_mode(), "codec": a.codec,
                        "batch": a.batch, "steps": a.steps, "threads": torch.get_num_threads(),
                        "command": " ".join(sys.argv), "wall_s": round(time.time() - t0, 1), "contexts": rows})


if __name__ == "__main__":
    main()
