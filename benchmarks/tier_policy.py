"""LRU against S3-FIFO for a KV tier, on a multi-tenant multi-turn trace with one-off documents.

The trace (seeded): ``--conversations`` conversations over ``--system-prompts`` shared system
prompts, each sending ``--turns`` turns round-robin in random order; a turn's prefix is its system
prompt's blocks, then its own history's blocks, then the new turn's. Between turns, with
probability ``--scan-rate``, a one-off document of ``--scan-blocks`` unique blocks is read (a RAG
page, a batch job): entries never reused. A tier of ``C`` block objects serves each prefix block
(hit, or miss then insert); the table gives the hit rate per policy and capacity. Pure Python,
the policies of ``kvserve.kv.eviction`` as the tiers use them. Writes JSON.

    python -m benchmarks.tier_policy [--capacities 200,400,800] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from kvserve.kv.eviction import EVICTION_POLICIES, make_policy


def trace(args: argparse.Namespace) -> list[list[str]]:
    rng = random.Random(args.seed)
    order = [(c, t) for t in range(args.turns) for c in rng.sample(range(args.conversations), args.conversations)]
    out: list[list[str]] = []
    scan = 0
    for c, t in order:
        system = [f"s{c % args.system_prompts}-{i}" for i in range(args.system_blocks)]
        history = [f"c{c}-{i}" for i in range((t + 1) * args.turn_blocks)]
        out.append(system + history)
        if rng.random() < args.scan_rate:
            out.append([f"doc{scan}-{i}" for i in range(args.scan_blocks)])
            scan += 1
    return out


def hit_rate(requests: list[list[str]], policy: str, capacity: int) -> float:
    order = make_policy(policy, [])
    held: set[str] = set()
    hits = total = 0
    for prefix in requests:
        for key in prefix:
            total += 1
            if key in held:
                hits += 1
                order.touch(key)  # type: ignore[arg-type]
                continue
            while len(held) >= capacity:
                held.discard(order.pop())  # type: ignore[arg-type]
            held.add(key)
            order.push(key)  # type: ignore[arg-type]
    return hits / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-blocks", type=int, default=8)
    ap.add_argument("--turn-blocks", type=int, default=4)
    ap.add_argument("--scan-rate", type=float, default=0.3)
    ap.add_argument("--scan-blocks", type=int, default=60)
    ap.add_argument("--capacities", default="200,400,800,1600")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="benchmarks/results/tier_policy.json")
    args = ap.parse_args()
    reqs = trace(args)
    caps = [int(c) for c in args.capacities.split(",")]
    table = {p: {str(c): hit_rate(reqs, p, c) for c in caps} for p in sorted(EVICTION_POLICIES)}
    print(f"{len(reqs)} requests, {sum(map(len, reqs)):,} block lookups")
    print(f"{'capacity (blocks)':<18}" + "".join(f"{p:>10}" for p in table))
    for c in caps:
        print(f"{c:<18}" + "".join(f"{table[p][str(c)]:>10.3f}" for p in table))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "hit_rate": table}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
