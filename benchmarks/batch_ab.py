"""Issue 14's 16-request figure with kvserve and llama.cpp alternating in one process.

    python benchmarks/batch_ab.py                 # 16 requests of 256 + 128 tokens, 3 rounds each
    python benchmarks/batch_ab.py --rounds 5

The same measurement as ``benchmarks/throughput.py``'s batch row (its ``kvserve_batched`` and
``llama_cpp_batched``: every request submitted at once; generated tokens/s over the whole run and
over the decode phase), but both engines are loaded once in this process and their runs
alternate, so a drift of the host hits both alike. ``throughput.py`` runs each engine in its own
subprocess one after the other: on the session-10 EPYC the host's speed moved 1.5x within minutes,
and llama.cpp's single-stream decode came out at 94.8 ms/token in one such run against 53-68 in
the run before, which moves the ratio as much as any kernel change. Medians per engine; prints
the CPU, a table and writes JSON (default ``benchmarks/results/batch_ab.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import throughput as T

from kvserve import LLM
from kvserve.bench.machine import cpu_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=T.CACHE / "qwen2.5-0.5b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "batch_ab.json")
    a = ap.parse_args()
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {a.threads}")
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed: bash benchmarks/setup_llama_cpp.sh") from None
    from benchmarks.llama_cpp_convert import to_gguf

    T.ensure_model(a.model, "bfloat16")
    args = argparse.Namespace(model=a.model, dtype="bfloat16", threads=a.threads, batch=a.batch,
                              batch_prompt=a.prompt, batch_new=a.new)
    gguf = to_gguf(a.model, T.CACHE / f"{a.model.name}-bf16.gguf", "bf16")
    ctx = a.batch * (a.prompt + a.new) + 64
    cpp = llama_cpp.Llama(model_path=str(gguf), n_ctx=ctx, n_threads=a.threads, n_threads_batch=a.threads,
                          n_batch=512, n_ubatch=512, verbose=False)
    llm = LLM(a.model, dtype="bfloat16", kv_cache_memory="3GiB", num_threads=a.threads, max_num_batched_tokens=2048,
              max_num_seqs=32, enable_prefix_caching=False)  # as throughput.py's kvserve worker
    prompts = [T.prompt_ids(a.prompt, 100 + i) for i in range(a.batch)]
    runs: dict[str, list[tuple[float, float]]] = {"kvserve": [], "llama.cpp": []}
    for rnd in range(a.rounds):
        order = ("kvserve", "llama.cpp") if rnd % 2 == 0 else ("llama.cpp", "kvserve")
        for name in order:
            runs[name].append(T.kvserve_batched(llm.engine, args, a.batch) if name == "kvserve"
                              else T.llama_cpp_batched(cpp, args, prompts))
            print(f"round {rnd}: {name} whole run {runs[name][-1][0]:.1f} tok/s, decode phase {runs[name][-1][1]:.1f}",
                  flush=True)
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in runs.items()}
    ratio = (med["kvserve"][0] / med["llama.cpp"][0], med["kvserve"][1] / med["llama.cpp"][1])
    print(f"\n{a.batch} requests ({a.prompt}+{a.new}), medians of {a.rounds} alternating runs")
    print(f"{'engine':<10} {'whole run tok/s':>16} {'decode phase tok/s':>19}")
    for k, (w, d) in med.items():
        print(f"{k:<10} {w:>16.1f} {d:>19.1f}")
    print(f"{'ratio':<10} {ratio[0]:>16.2f} {ratio[1]:>19.2f}")
    doc = {"cpu": cpu, "command": " ".join(["python", "benchmarks/batch_ab.py", *sys.argv[1:]]), "threads": a.threads,
           "batch": a.batch, "prompt": a.prompt, "new": a.new, "runs": runs,
           "median": {k: {"whole_run_tok_s": w, "decode_phase_tok_s": d} for k, (w, d) in med.items()},
           "ratio_whole_run": ratio[0], "ratio_decode_phase": ratio[1]}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
