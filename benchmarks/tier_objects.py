"""Per-block costs of the KV tiers on this machine: export, encode + checksum, decode + verify,
import, disk write (with and without fsync) and read, for one Qwen2.5-0.5B-shaped bf16 block
(24 layers, 2 KV heads, head dim 64, 16 tokens: 196 KB). Medians; prints a table, writes JSON.

    python -m benchmarks.tier_objects [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.runner_overhead import cpu_info
from kvserve.kv.block_io import export_block, import_block
from kvserve.kv.quant import parse_kv_codecs
from kvserve.kv.storage import KVStorage
from kvserve.kv.tiers import object_format
from kvserve.kv.tiers.disk import DiskTier


def median_ms(fn: Callable[[], object], n: int = 50) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default="benchmarks/results/tier_objects.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    s = KVStorage(num_layers=24, num_blocks=8, block_size=16, kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                  pool=parse_kv_codecs("bfloat16"), group_size=16)
    for t in s.plain or []:
        t.normal_()
    payload = export_block(s, 3)
    root, key = b"r" * 16, b"h" * 16
    data = object_format.encode(payload, root=root, block_hash=key, parent=b"")
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        synced, unsynced = DiskTier(d1, 1 << 30), DiskTier(d2, 1 << 30, fsync=False)
        synced.put(key, data)
        rows = {
            "export": median_ms(lambda: export_block(s, 3)),
            "encode_checksum": median_ms(lambda: object_format.encode(payload, root=root, block_hash=key, parent=b"")),
            "decode_verify": median_ms(lambda: object_format.decode(data, root=root, block_hash=key)),
            "import": median_ms(lambda: import_block(s, payload, 5)),
            "disk_write_fsync": median_ms(lambda: synced.put(key, data), 20),
            "disk_write_no_fsync": median_ms(lambda: unsynced.put(key, data), 20),
            "disk_read": median_ms(lambda: synced.get(key), 20),
        }
    info = cpu_info()
    print(f"CPU: {info['model']}  flags: {' '.join(info['flags'])}  block object: {len(data):,} bytes")
    for name, ms in rows.items():
        print(f"{name:<22} {ms:8.3f} ms")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": info, "object_bytes": len(data), "median_ms": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
