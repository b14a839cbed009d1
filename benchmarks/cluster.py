"""Routers side by side on one multi-tenant, multi-turn trace against 2 replicas (Ray actors).

The trace: ``--conversations`` conversations of ``--turns`` turns, each opening with one of
``--system-prompts`` shared system prompts (a tenant's), arriving as a Poisson process
(``--rate`` conversations/s), each turn sent after the previous reply plus an exponential think
time; every turn resends the whole history (as OpenAI clients do, no session), so what a turn can
reuse is the system prompt and its own conversation's earlier turns. The same trace (same seed)
runs once per router on fresh replicas: ``round_robin``, ``session_hash`` (hash of the
conversation id) and ``kv`` (the exact, tier-aware router).

Per router: ``hit_rate`` (prompt tokens the engines reused ÷ prompt tokens), ``oracle_ratio``
(blocks the chosen replicas held ÷ blocks the best replica held, replaying every replica's cache
events to each decision: :mod:`kvserve.cluster.oracle`), TTFT p50/p90 (arrival at the replica set
to the first token) and generated tokens/s over the run.

    python -m benchmarks.cluster [--conversations 16 --turns 4] [--json FILE]

The issue's shape is 64 conversations x 8 turns; the defaults are smaller so a run fits this
2-core machine (shared) in a few minutes; pass the full shape where there is room.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.runner_overhead import cpu_info
from kvserve.cluster.launch import ClusterConfig, init_ray, launch_replica_set
from kvserve.cluster.oracle import replay_oracle
from kvserve.cluster.router import POLICIES, RouterConfig
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.llm import resolve_model_path
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Conversation:
    cid: str
    system: int
    start_s: float
    users: tuple[tuple[int, ...], ...]
    think_s: tuple[float, ...]


def make_trace(args: argparse.Namespace) -> tuple[list[list[int]], list[Conversation]]:
    rng = random.Random(args.seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, 4000) for _ in range(n)]

    systems = [toks(args.system_len) for _ in range(args.system_prompts)]
    convs, t = [], 0.0
    for i in range(args.conversations):
        t += rng.expovariate(args.rate)
        convs.append(Conversation(f"conv-{i}", rng.randrange(args.system_prompts), t,
                                  tuple(tuple(toks(args.user_len)) for _ in range(args.turns)),
                                  tuple(rng.expovariate(1 / args.think_s) for _ in range(args.turns))))
    return systems, convs


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    generated: int
    ttft_s: float


async def run_conversation(rs: Any, system: list[int], conv: Conversation, reply_len: int, t0: float,
                           out: list[Turn]) -> None:
    await asyncio.sleep(max(0.0, conv.start_s - (time.monotonic() - t0)))
    history = list(system)
    params = SamplingParams(max_tokens=reply_len, temperature=0, ignore_eos=True)
    for user, think in zip(conv.users, conv.think_s, strict=True):
        prompt = history + list(user)
        start = time.monotonic()
        stream = await rs.add_request(prompt, params, routing_key=conv.cid)
        first: float | None = None
        final = None
        async for o in stream:
            if first is None and o.outputs[0].token_ids:
                first = time.monotonic() - start
            final = o
        assert final is not None and first is not None
        out.append(Turn(len(prompt), final.num_cached_tokens, len(final.outputs[0].token_ids), first))
        history = prompt + list(final.outputs[0].token_ids)
        await asyncio.sleep(think)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_router(policy: str, engine: EngineConfig, cluster: ClusterConfig, systems: list[list[int]],
                     convs: list[Conversation], reply_len: int) -> dict[str, float]:
    rs = await asyncio.to_thread(launch_replica_set, engine, cluster, RouterConfig(policy=policy))
    try:
        rs.start()
        turns: list[Turn] = []
        t0 = time.monotonic()
        await asyncio.gather(*(run_conversation(rs, systems[c.system], c, reply_len, t0, turns) for c in convs))
        wall = time.monotonic() - t0
        decisions = rs.policy.decisions
        t1 = time.monotonic()  # a router restart: the index rebuilt from the replicas' snapshots
        held_before = {r: rs.index.held(r) for r in rs.up()}
        rs.restart_router()
        await rs.refresh()
        rebuild_s = time.monotonic() - t1
        assert {r: rs.index.held(r) for r in rs.up()} == held_before
        logs = await rs.replica_events()
        oracle = replay_oracle(rs.decision_log, logs, rs.info.block_size)
        ttfts = [t.ttft_s for t in turns]
        led = rs.transfers
        pd = {"pd_transfers": led.transfers, "pd_blocks": led.blocks, "pd_bytes": led.bytes,
              "pd_transfer_s": led.seconds, "pd_fallbacks": led.fallbacks, "pd_skipped": led.skipped} \
            if rs.prefill else {}
        return {"hit_rate": sum(t.cached_tokens for t in turns) / sum(t.prompt_tokens for t in turns),
                "oracle_ratio": oracle.ratio, "oracle_hit_rate_blocks": oracle.oracle_rate,
                "achieved_hit_rate_blocks": oracle.achieved_rate,
                "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": pct(ttfts, 0.9),
                "tokens_per_s": sum(t.generated for t in turns) / wall, "requests": len(turns), "wall_s": wall,
                "decisions": dict(decisions), "index_blocks": len(rs.index), "index_rebuild_s": rebuild_s,
                "poll_rounds": rs.poll_rounds, **pd}
    finally:
        await asyncio.to_thread(rs.shutdown)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--reply-len", type=int, default=8)
    ap.add_argument("--rate", type=float, default=2.0, help="conversations arriving per second (Poisson)")
    ap.add_argument("--think-s", type=float, default=0.5, help="mean think time between turns")
    ap.add_argument("--num-blocks", type=int, default=96, help="KV blocks per replica (16 tokens each)")
    ap.add_argument("--routers", default="round_robin,session_hash,kv")
    ap.add_argument("--pd", action="store_true",
                    help="also run kv_pd: the kv router over a prefill/decode split (1 prefill + 1 decode replica)")
    ap.add_argument("--pd-channel", default="direct", help="with --pd: direct (TCP) or object_store")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    routers = args.routers.split(",")
    assert all(r in POLICIES for r in routers), routers
    info = cpu_info()
    model = resolve_model_path(None)
    print(f"CPU: {info['model']}  flags: {' '.join(info['flags'])}  model: {model}")
    print(f"trace: {args.conversations} conversations x {args.turns} turns, {args.system_prompts} system prompts "
          f"of {args.system_len} tokens, user turns {args.user_len} tokens, replies {args.reply_len} tokens, "
          f"{args.rate}/s Poisson, think {args.think_s} s; 2 replicas x {args.num_blocks} blocks of 16 tokens")
    engine = EngineConfig(model=model, dtype="float32", device="cpu", seed=0, num_threads=1,
                          cache=CacheConfig(block_size=16, num_blocks_override=args.num_blocks),
                          scheduler=SchedulerConfig(max_model_len=1024))
    cluster = ClusterConfig(replicas=2, num_cpus=2, object_store_bytes=128 * 2**20, cpus_per_replica=1.0)
    init_ray(cluster)  # one Ray for every run: each router gets fresh replicas
    systems, convs = make_trace(args)
    results: dict[str, dict[str, float]] = {}
    runs = [(p, p, cluster) for p in routers]
    if args.pd:
        runs.append(("kv_pd", "kv", dataclasses.replace(cluster, prefill_replicas=1, pd_channel=args.pd_channel)))
    for name, policy, ccfg in runs:
        eng = engine
        results[name] = asyncio.run(run_router(policy, eng, ccfg, systems, convs, args.reply_len))
        r = results[name]
        print(f"{name:>13}: hit rate {r['hit_rate']:.3f}  oracle ratio {r['oracle_ratio']:.3f}  "
              f"TTFT p50 {r['ttft_p50_s'] * 1000:.0f} ms  p90 {r['ttft_p90_s'] * 1000:.0f} ms  "
              f"{r['tokens_per_s']:.1f} tok/s  ({r['requests']} requests, {r['wall_s']:.1f} s) {r['decisions']}; "
              f"index of {r['index_blocks']} blocks rebuilt in {r['index_rebuild_s'] * 1000:.1f} ms")
        if "pd_bytes" in r:
            print(f"{'':>13}  P/D ledger: {r['pd_transfers']} transfers, {r['pd_blocks']} blocks, "
                  f"{r['pd_bytes'] / 2**20:.1f} MiB in {r['pd_transfer_s']:.2f} s, {r['pd_fallbacks']} fallbacks, "
                  f"{r['pd_skipped']} skipped")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": info, "args": vars(args), "routers": results}, f, indent=2)


if __name__ == "__main__":
    main()
