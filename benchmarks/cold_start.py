"""How long `kvserve serve` takes, on a machine that has never built its kernels, to answer its
first request: seconds to ``/health``, then each of ``--requests`` chat completions in turn.

    PYTHONPATH=$PWD python benchmarks/cold_start.py                     # the working tree
    PYTHONPATH=$PWD python benchmarks/cold_start.py --rev b8c298e --rev HEAD

Each run starts from an empty ``KVSERVE_CACHE_DIR`` (nothing built, no GEMM plan, no attention
choice cached), so it times what a fresh install does; ``--warm`` runs once more on that run's
cache. A ``--rev`` other than the working tree is checked out as a git worktree under a
temporary folder and served from there with this interpreter. Runs go one after another (each
is minutes; the host's noise is seconds). Prints the CPU and a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve.bench.machine import cpu_info
from kvserve.bench.results import write_json

BODY = {"model": "kvserve-tiny-chat", "messages": [{"role": "user", "content": "Reverse a list."}],
        "max_tokens": 32, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, body: dict | None = None, timeout: float = 900) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def serve_once(tree: Path, cache: Path, requests: int, model: str | None) -> dict:
    """One server from ``tree`` on ``cache``: seconds to /health and per request, and its log."""
    port = free_port()
    env = {**os.environ, "KVSERVE_CACHE_DIR": str(cache), "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-c", "from kvserve.cli import main; main()", "serve", "--port", str(port)]
    if model:
        cmd += ["--model", model]
    log = cache / f"serve-{time.time_ns()}.log"
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}")
            try:
                get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.25)
        ready = time.perf_counter() - t0
        body = {**BODY, "model": model} if model else BODY
        times = []
        for _ in range(requests):
            t = time.perf_counter()
            get(f"http://127.0.0.1:{port}/v1/chat/completions", body)
            times.append(time.perf_counter() - t)
    finally:
        proc.terminate()
        proc.wait(30)
    lines = [ln for ln in log.read_text().splitlines() if "native kernel" in ln]
    return {"ready_s": ready, "request_s": times, "first_answer_s": ready + times[0], "native_log": lines}


def worktree(rev: str, tmp: Path) -> Path:
    path = tmp / f"tree-{rev}"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True,
                   capture_output=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", action="append", default=[], help="a git revision, or . for the working tree (repeatable; default: .)")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--model", default=None, help="served model (default: the embedded one)")
    ap.add_argument("--warm", action="store_true", help="also time a second start on the same cache")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "cold_start.json")
    args = ap.parse_args()
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-cold-") as tmpdir:
        tmp = Path(tmpdir)
        trees = []
        try:
            for rev in args.rev or ["working tree"]:
                tree = ROOT if rev in ("working tree", ".") else worktree(rev, tmp)
                if tree != ROOT:
                    trees.append(tree)
                cache = tmp / f"cache-{len(runs)}"
                cache.mkdir()
                runs[rev] = {"cold": serve_once(tree, cache, args.requests, args.model)}
                if args.warm:
                    runs[rev]["warm"] = serve_once(tree, cache, args.requests, args.model)
        finally:
            for tree in trees:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    print(f"\n{'revision':<14} {'start':<5} {'to /health s':>13} {'request 1 s':>12} {'request 2 s':>12} {'first answer s':>15}")
    for rev, r in runs.items():
        for kind, x in r.items():
            second = f"{x['request_s'][1]:>12.2f}" if len(x["request_s"]) > 1 else f"{'':>12}"
            print(f"{rev:<14} {kind:<5} {x['ready_s']:>13.1f} {x['request_s'][0]:>12.2f} {second} {x['first_answer_s']:>15.1f}")
    write_json(args.json, {"cpu": cpu, "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs})


if __name__ == "__main__":
    main()
