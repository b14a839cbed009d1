"""What a prefill/decode split costs and saves per prompt: computing a prompt's KV on the decode
replica itself against receiving it from a prefill replica, over the direct TCP channel and over
Ray's object store (issue "Scale out on Ray", item 3).

Two replicas (Ray actors, one CPU each) of one model: ``p0`` computes each prompt
(``max_tokens=1``), then its full blocks go to ``d0`` by ``SendBlocks``/``ReceiveBlocks``
(:func:`kvserve.cluster.pd.move_blocks`), once per channel, each time into a fresh copy of the
prompt's blocks (a new cache salt, so ``d0`` holds nothing of it before). Per prompt length:

* ``prefill_s``: the prompt computed on one replica (what ``d0`` does without the split);
* ``direct_s`` / ``object_store_s``: one transfer, from the receiver's ``begin_receive`` to its
  ``finish_receive`` (blocks findable), median of ``--repeats``; GB/s of block objects;
* ``ttft_after_s``: ``d0``'s time to first token on the prompt once the blocks are there.

    python -m benchmarks.pd_transfer [--model DIR] [--lengths 256,1024,2048] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

from kvserve.bench.machine import cpu_info
from kvserve.cluster.launch import ClusterConfig, launch_replica_set
from kvserve.cluster.pd import CHANNELS, move_blocks
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.llm import resolve_model_path
from kvserve.kv.hashing import hash_full_blocks, request_root
from kvserve.sampling_params import SamplingParams


async def timed_request(rs: Any, prompt: list[int], salt: str, replica: str) -> float:
    t0 = time.monotonic()
    stream = await rs.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), cache_salt=salt,
                                  replica=replica)
    await stream.result()
    return time.monotonic() - t0


async def measure(rs: Any, lengths: list[int], repeats: int, vocab: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    for replica in ("p0", "d0"):  # first use: kernel choices, page faults
        await timed_request(rs, [rng.randrange(10, vocab - 10) for _ in range(64)], "warm-up", replica)
    rows = []
    for n in lengths:
        prompt = [rng.randrange(10, vocab - 10) for _ in range(n)]
        row: dict[str, Any] = {"tokens": n}
        for channel in CHANNELS:
            rs.pd_channel = channel
            times, nbytes, blocks = [], 0, 0
            for i in range(repeats):
                salt = f"{channel}-{n}-{i}"
                prefill = await timed_request(rs, prompt, salt, "p0")
                row.setdefault("prefill_s", []).append(prefill)
                hashes = hash_full_blocks(prompt, rs.info.block_size, request_root(rs.info.root_key, None, salt))
                b0, t0 = rs.transfers.bytes, time.monotonic()
                blocks = await move_blocks(rs, "p0", "d0", hashes, timeout_s=30.0)
                times.append(time.monotonic() - t0)
                nbytes = rs.transfers.bytes - b0
                row.setdefault("ttft_after_s", []).append(await timed_request(rs, prompt, salt, "d0"))
            row[f"{channel}_s"] = statistics.median(times)
            row[f"{channel}_gb_s"] = nbytes / row[f"{channel}_s"] / 1e9
            row["blocks"], row["bytes"] = blocks, nbytes
        row["prefill_s"] = statistics.median(row["prefill_s"])
        row["ttft_after_s"] = statistics.median(row["ttft_after_s"])
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory (default: the embedded model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-mib", type=int, default=384, help="KV pool per replica")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    info = cpu_info()
    model = resolve_model_path(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"CPU: {info['model']}  flags: {' '.join(info['flags'])}  model: {model} ({args.dtype})")
    engine = EngineConfig(model=model, dtype=args.dtype, device="cpu", seed=0, num_threads=1,
                          cache=CacheConfig(block_size=16, kv_cache_memory=args.kv_mib * 2**20),
                          scheduler=SchedulerConfig(max_model_len=max(lengths) + 16))
    cluster = ClusterConfig(replicas=2, prefill_replicas=1, num_cpus=2, object_store_bytes=256 * 2**20,
                            cpus_per_replica=1.0)
    rs = launch_replica_set(engine, cluster)

    async def go() -> list[dict[str, Any]]:
        rs.start()
        try:
            return await measure(rs, lengths, args.repeats, rs.info.vocab_size)
        finally:
            await asyncio.to_thread(rs.shutdown)
    rows = asyncio.run(go())
    print(f"{'tokens':>7} {'MiB':>6} {'prefill s':>10} {'direct s':>9} {'GB/s':>6} {'obj store s':>12} {'GB/s':>6} "
          f"{'TTFT after s':>13} {'prefill/direct':>15}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['bytes'] / 2**20:>6.1f} {r['prefill_s']:>10.3f} {r['direct_s']:>9.4f} "
              f"{r['direct_gb_s']:>6.2f} {r['object_store_s']:>12.4f} {r['object_store_gb_s']:>6.2f} "
              f"{r['ttft_after_s']:>13.3f} {r['prefill_s'] / r['direct_s']:>15.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": info, "args": vars(args), "model": model, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
