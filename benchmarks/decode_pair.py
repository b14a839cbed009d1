"""Single-stream decode, kvserve against llama.cpp, both engines loaded at once, runs alternating.

``benchmarks/throughput.py`` runs each engine in its own subprocess, one after the other: on a host
whose read bandwidth swings between ~30 and ~70 GB/s within minutes (the 2-core EPYC VMs here), the
engine that happens to run in a fast phase wins the decode rows (session 18: llama.cpp's three
decode runs saw probes of 61-74 GB/s, kvserve's 31-62). Here both engines are loaded side by side, each in a worker process
(``throughput.kvserve_runner``, ``throughput.llama_cpp_runner``: the same checkpoint, the GGUF in
the same precision, the same threads) and each round runs one decode of ``--tokens`` tokens per
engine back to back, the order swapped every round, so a phase hits both. Per context: each
engine's median ms/token, the paired ratio (each round's kvserve run against llama.cpp's of the
same round: median, 95 % interval, share of rounds kvserve was the faster) and the bandwidth probe
taken before each round.

    PYTHONPATH=$PWD python benchmarks/decode_pair.py                     # 512 and 2,048, 9 rounds
    PYTHONPATH=$PWD python benchmarks/decode_pair.py --contexts 2048 --rounds 15

Needs llama-cpp-python (``benchmarks/setup_llama_cpp.sh``). Prints a table and writes JSON
(default ``benchmarks/results/decode_pair.json``).

Each engine lives in its own worker process (this script with ``--serve ENGINE``), loaded once and
fed one run at a time over a pipe: an idle worker blocks on its pipe, so neither engine's threads
(torch's OpenMP team, ggml's) share a runtime with or spin beside the other's runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kv_quant import paired_ratio, paired_text
from throughput import CACHE, ensure_model, kvserve_runner, llama_cpp_runner, probe_bandwidth, prompt_ids

from kvserve.bench.results import write_json


def serve(engine: str, a: argparse.Namespace, contexts: list[int]) -> None:
    """Worker: load ``engine``, then per stdin line ``context seed`` one decode run; prints ms/token."""
    args = argparse.Namespace(model=a.model, dtype="bfloat16", threads=a.threads, device="cpu",
                              prefill=contexts, context=contexts, decode_tokens=a.tokens)
    _, run = (kvserve_runner if engine == "kvserve" else llama_cpp_runner)(args)
    run(prompt_ids(64, 9), 4)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        n, seed = (int(x) for x in line.split())
        print(1e3 * run(prompt_ids(n, seed), a.tokens)[1], flush=True)


class Worker:
    """One engine's worker process: ``run(context, seed)`` -> ms per decode token."""

    def __init__(self, engine: str, argv: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen([sys.executable, __file__, *argv, "--serve", engine], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        if self.proc.stdout is None or self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"{engine} worker failed to start (llama.cpp: benchmarks/setup_llama_cpp.sh)")

    def run(self, n: int, seed: int) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{n} {seed}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "decode_pair.json")
    ap.add_argument("--serve", choices=("kvserve", "llama.cpp"), help=argparse.SUPPRESS)
    raw = sys.argv[1:] if argv is None else argv
    a = ap.parse_args(raw)
    contexts = [int(c) for c in a.contexts.split(",")]
    if a.serve:
        serve(a.serve, a, contexts)
        return
    from kvserve.bench.machine import cpu_info

    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {a.threads}", file=sys.stderr)
    ensure_model(a.model, "bfloat16")
    engines = {e: Worker(e, raw) for e in ("kvserve", "llama.cpp")}
    rows: dict[str, dict] = {}
    t0 = time.time()
    try:
        for n in contexts:
            ms: dict[str, list[float]] = {e: [] for e in engines}
            probes: list[float] = []
            for r in range(a.rounds):
                probes.append(probe_bandwidth(a.threads))
                for e in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                    ms[e].append(engines[e].run(n, 3 + r))
            p = paired_ratio(ms["kvserve"], ms["llama.cpp"])
            rows[str(n)] = {"ms_per_token": {e: statistics.median(v) for e, v in ms.items()}, "runs_ms": ms,
                            "probe_gb_s": probes, "paired_kvserve_vs_llama_cpp": p}
    finally:
        for w in engines.values():
            w.close()
    print(f"{'context':>8} {'kvserve ms/tok':>15} {'llama.cpp ms/tok':>17} {'time ratio, paired (95% CI)':>30} "
          f"{'kvserve faster':>15} {'probe GB/s':>12}")
    for n, row in rows.items():
        p, m = row["paired_kvserve_vs_llama_cpp"], row["ms_per_token"]
        print(f"{n:>8} {m['kvserve']:>15.2f} {m['llama.cpp']:>17.2f} {paired_text(p):>30} "
              f"{p['faster_share']:>15.0%} {statistics.median(row['probe_gb_s']):>12.1f}")
    write_json(a.json, {"cpu": cpu, "threads": a.threads, "command": " ".join(sys.argv), "tokens": a.tokens,
                        "rounds": a.rounds, "wall_s": round(time.time() - t0, 1), "contexts": rows})


if __name__ == "__main__":
    main()
