"""A session turn's KV bookkeeping against the turn number: the KV manager alone, no model.

Each turn of one session sends ``--user-tokens`` new tokens and decodes ``--new-tokens``, as
``kvserve bench turns`` does; per turn this times what the scheduler asks of the manager
(``get_computed_blocks``, ``miss_reasons``, ``allocate_slots`` and ``cache_blocks`` for the
prefill, the same per decoded token, ``free``). With ``--rev REV`` the same script also runs on
the ``kvserve`` package as it was at git revision REV (exported to a temporary folder), in
alternating rounds, so the two columns share the host's drift. Prints medians in µs per turn
(first step = the prefill's calls; turn = all of it) and writes JSON.

    PYTHONPATH=$PWD python benchmarks/session_bookkeeping.py --rev 532851e   # before the hash carry
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TURNS = (1, 2, 10, 20, 37, 40)


def one_run(turns: int, user: int, new: int, block_size: int) -> dict[int, tuple[float, float]]:
    """Per turn: (seconds in the prefill's calls, seconds in the whole turn's calls)."""
    from kvserve.kv.manager import KVCacheManager
    from kvserve.request import Request, RequestStatus
    from kvserve.sampling_params import SamplingParams

    kv = KVCacheManager(num_blocks=(turns + 1) * (user + new) // block_size + 8, block_size=block_size)
    history: list[int] = []
    out: dict[int, tuple[float, float]] = {}
    for t in range(1, turns + 1):
        kv.begin_turn("s")
        req = Request(f"t{t}", history + [(t * 7919 + i) % 32000 for i in range(user)],
                      SamplingParams(max_tokens=new), session_id="s")
        t0 = time.perf_counter()
        computed = kv.get_computed_blocks(req)
        kv.miss_reasons(req, computed)
        assert kv.allocate_slots(req, req.num_tokens - computed.num_tokens, computed)
        req.num_computed_tokens = req.num_tokens
        kv.cache_blocks(req)
        t1 = time.perf_counter()
        for i in range(new):
            req.append_token((t + i) % 32000)
            if i < new - 1:
                assert kv.allocate_slots(req, 1)
                req.num_computed_tokens += 1
                kv.cache_blocks(req)
        req.status = RequestStatus.FINISHED_LENGTH
        kv.free(req)
        out[t] = (t1 - t0, time.perf_counter() - t0)
        history = req.all_token_ids
    return out


def export(rev: str) -> Path:
    """The ``kvserve`` package at ``rev`` in a temporary folder (for PYTHONPATH)."""
    blob = subprocess.run(["git", "archive", rev, "kvserve"], cwd=ROOT, check=True, capture_output=True).stdout
    dest = Path(tempfile.mkdtemp(prefix=f"kvserve-{rev}-"))
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def child(path: Path, a: argparse.Namespace) -> dict[int, tuple[float, float]]:
    env = {**os.environ, "PYTHONPATH": str(path)}
    cmd = [sys.executable, __file__, "--child", "--turns", str(a.turns), "--user-tokens", str(a.user_tokens),
           "--new-tokens", str(a.new_tokens), "--block-size", str(a.block_size)]
    res = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return {int(k): tuple(v) for k, v in json.loads(res.stdout).items()}  # type: ignore[misc]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--rev", default=None)
    p.add_argument("--json", default="benchmarks/results/session_bookkeeping.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(one_run(a.turns, a.user_tokens, a.new_tokens, a.block_size)))
        return
    from kvserve.bench.machine import cpu_info

    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  (pure Python, one thread)")
    trees = {"working tree": ROOT} | ({f"@{a.rev}": export(a.rev)} if a.rev else {})
    runs: dict[str, list[dict[int, tuple[float, float]]]] = {name: [] for name in trees}
    for _ in range(a.rounds):
        for name, path in trees.items():
            runs[name].append(child(path, a))
    table: dict[str, dict[str, dict[str, float]]] = {}
    print(f"{'turn':>5} " + " ".join(f"{n + ' ' + c:>26}" for n in trees for c in ("first step", "turn")) + "  (µs)")
    for t in (x for x in TURNS if x <= a.turns):
        row = []
        for name in trees:
            first = statistics.median(r[t][0] for r in runs[name]) * 1e6
            whole = statistics.median(r[t][1] for r in runs[name]) * 1e6
            table.setdefault(name, {})[str(t)] = {"first_step_us": first, "turn_us": whole}
            row += [first, whole]
        print(f"{t:>5} " + " ".join(f"{v:>26.0f}" for v in row))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"cpu": cpu, "args": vars(a), "medians": table}, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
