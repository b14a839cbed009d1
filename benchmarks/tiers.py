"""KV tiers: what a returning conversation pays when its KV left the pool, side by side.

Three engines on the same model and prompts: a pool big enough to hold every conversation
(``big``), a small pool with host + disk tiers (``tiers``), the same small pool without tiers
(``recompute``). Each runs ``--conversations`` sessions round-robin for ``--turns`` turns, so with
the small pool every conversation's KV is evicted before its next turn. Reports median TTFT per
turn (turn 1 excluded), the ratios, and the disk tier's index rebuild time (a new engine on the
same directory), with the CPU model and flags. Writes JSON.

    python -m benchmarks.tiers [--model DIR] [--dtype bfloat16] [--conversations 8] [--turns 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.runner_overhead import cpu_info
from kvserve import LLM, SamplingParams
from kvserve.engine.llm import resolve_model_path


def turn_ids(conv: int, turn: int, n: int) -> list[int]:
    return [(37 * conv + 11 * turn + i) % 3000 + 100 for i in range(n)]


def run(llm: LLM, conversations: int, turns: int, user: int, reply: int,
        places: dict[str, int]) -> list[list[float]]:
    """Median-ready TTFTs per turn; ``places`` accumulates, over turns 2+, the prompt tokens
    reused per place (pool, host, disk) and recomputed."""
    params = SamplingParams(max_tokens=reply, temperature=0.0, ignore_eos=True)
    ttft: list[list[float]] = [[] for _ in range(turns)]
    for t in range(turns):
        for c in range(conversations):
            t0 = time.perf_counter()
            out = llm.generate({"prompt_token_ids": turn_ids(c, t, user)}, params, session_id=f"c{c}")[0]
            assert out.metrics is not None and out.metrics.ttft is not None
            ttft[t].append(out.metrics.ttft if out.metrics.ttft > 0 else time.perf_counter() - t0)
            if t:
                for place, n in out.kv_hit_tokens.items():
                    places[place] = places.get(place, 0) + n
                places["recomputed"] = places.get("recomputed", 0) + len(out.prompt_token_ids) - out.num_cached_tokens
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, default=96)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--small-pool-tokens", type=int, default=0, help="default: about two conversations' history")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default="benchmarks/results/tiers.json")
    args = ap.parse_args()
    model = resolve_model_path(args.model)
    info = cpu_info()
    print(f"CPU: {info['model']}  flags: {' '.join(info['flags'])}  threads: {args.threads}  model: {model}")
    history = args.turns * (args.user_tokens + args.reply_tokens)
    small = args.small_pool_tokens or 2 * history + 64
    big = args.conversations * history * 2
    common = {"dtype": args.dtype, "block_size": 16, "num_threads": args.threads, "max_model_len": history + 64}
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as d:
        setups = {
            "big": {"num_blocks": -(-big // 16)},
            "tiers": {"num_blocks": -(-small // 16), "kv_host_memory": "256MiB", "kv_disk_dir": d},
            "recompute": {"num_blocks": -(-small // 16)},
        }
        for name, kw in setups.items():
            llm = LLM(model, **common, **kw)  # type: ignore[arg-type]
            places: dict[str, int] = {}
            ttft = run(llm, args.conversations, args.turns, args.user_tokens, args.reply_tokens, places)
            later = [x for turn in ttft[1:] for x in turn]
            results[name] = {"ttft_median_s": statistics.median(later),
                             "ttft_per_turn_s": [statistics.median(t) for t in ttft],  # type: ignore[dict-item]
                             "tokens_turns_2plus": places}  # type: ignore[dict-item]
            del llm
        t0 = time.perf_counter()
        again = LLM(model, **common, num_blocks=-(-small // 16), kv_disk_dir=d)  # type: ignore[arg-type]
        restart_s = time.perf_counter() - t0
        disk = again.engine.runner.tiers.tiers[0]
        results["restart"] = {"engine_start_s": restart_s, "disk_blocks": disk.rebuilt,
                              "index_rebuild_s": disk.rebuild_seconds,
                              "rebuild_s_per_10k_blocks": disk.rebuild_seconds / max(1, disk.rebuilt) * 10_000}
    b, t, r = (results[k]["ttft_median_s"] for k in ("big", "tiers", "recompute"))
    print(f"{'setup':<10} {'median TTFT turns 2+ (s)':>26}")
    for k in ("big", "tiers", "recompute"):
        print(f"{k:<10} {results[k]['ttft_median_s']:>26.4f}   prompt tokens, turns 2+: {results[k]['tokens_turns_2plus']}")
    print(f"tiers / big = {t / b:.2f}   recompute / tiers = {r / t:.2f}")
    rs = results["restart"]
    print(f"restart: engine start {rs['engine_start_s']:.2f} s, disk index of {rs['disk_blocks']} blocks rebuilt in "
          f"{rs['index_rebuild_s'] * 1e3:.1f} ms ({rs['rebuild_s_per_10k_blocks'] * 1e3:.0f} ms per 10k blocks)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": info, "model": model, "args": vars(args), "results": results,
                                           "ratios": {"tiers_over_big": t / b, "recompute_over_tiers": r / t}}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
