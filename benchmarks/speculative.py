"""Speculative decoding by n-gram lookup: single-stream tokens/s with and without, in one run.

Workloads (each run with ``speculative=None`` and ``speculative="ngram"`` on engines built the same
way, alternating, median of ``--repeats``; the outputs are checked token for token equal):

* ``edit`` — a code-editing chat session on the embedded trained model (kvserve-tiny-chat): turn 1
  asks for a function, the next turns ask for the same function with a change; the model repeats
  most of its previous answer. Tokens/s of the edit turns (turn 2 on).
* ``self-repeat`` — the 0.5B shape (random weights), greedy: such a model falls into loops of its
  own, so what it writes repeats what it wrote (a stand-in for repetitive output on this shape).
* ``nothing`` — the 0.5B shape, sampled at temperature 1 with a seed: a random model's near-flat
  distribution over 151k tokens repeats nothing, so drafts are almost never found (the cost of
  looking, and of the few wrong verifies).

    python benchmarks/speculative.py                 # all three, ~6 min on 2 cores
    python benchmarks/speculative.py --workloads edit --repeats 5
    python benchmarks/speculative.py --quick         # fewer tokens, a smoke run

Prints a table and writes JSON (default benchmarks/results/speculative.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "kvserve" / "assets" / "models" / "kvserve-tiny-chat"
SHAPE = ROOT / "benchmarks" / ".cache" / "qwen2.5-0.5b"
EDITS = [
    "Write a function that reads a config file into a dict.",
    "Same function again, but name it load_config.",
    "Again, and add a docstring.",
    "Once more, with the path as a pathlib.Path.",
]


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def cpu_line() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor()
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile") if f in flags]
    return f"{info.get('Model name', '?').strip()} ({', '.join(wanted) or 'no AVX2'})"


def edit_session(llm: LLM, session: str, new: int) -> tuple[int, float, list[list[int]]]:
    """Tokens and seconds of the edit turns (turn 2 on), and every turn's tokens."""
    params = SamplingParams(max_tokens=new, temperature=0)
    tokens, seconds, outs = 0, 0.0, []
    for i, text in enumerate(EDITS):
        t = time.perf_counter()
        out = llm.chat([{"role": "user", "content": text}], params, session_id=session)[0]
        dt = time.perf_counter() - t
        outs.append(out.outputs[0].token_ids)
        if i:
            tokens, seconds = tokens + len(out.outputs[0].token_ids), seconds + dt
    llm.close_session(session)
    return tokens, seconds, outs


def one_request(llm: LLM, seed: int, prompt_len: int, new: int, temperature: float) -> tuple[int, float, list[list[int]]]:
    prompt = [10 + (i * 7919 + seed * 104729) % 3990 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=new, temperature=temperature, seed=seed, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    return len(out.outputs[0].token_ids), time.perf_counter() - t, [out.outputs[0].token_ids]


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    tiny = name == "edit"
    model = TINY if tiny else SHAPE
    kw: dict[str, Any] = {"kv_cache_memory": "512MiB", "num_threads": args.threads, "block_size": 16}
    engines = {mode: LLM(model, speculative=mode, num_speculative_tokens=args.k, **kw) for mode in (None, "ngram")}
    new = (args.new // 2 if args.quick else args.new) * (2 if tiny else 1)
    runs: dict[str, list[float]] = {"off": [], "ngram": []}
    same = True
    for r in range(args.repeats):
        outs = {}
        for mode, llm in engines.items():
            if tiny:
                n, dt, toks = edit_session(llm, f"s{r}", new)
            else:
                n, dt, toks = one_request(llm, r + 1, args.prompt, new, 0.0 if name == "self-repeat" else 1.0)
            runs["ngram" if mode else "off"].append(n / dt)
            outs[mode] = toks
        same = same and outs[None] == outs["ngram"]
    st = engines["ngram"].engine.stats()
    off, on = median(runs["off"]), median(runs["ngram"])
    return {"workload": name, "model": model.name, "tok_s_off": off, "tok_s_ngram": on, "ratio": on / off,
            "runs": runs, "identical_tokens": same, "verifies": st.spec_verifies,
            "draft_tokens": st.spec_draft_tokens, "accepted_tokens": st.spec_accepted_tokens,
            "acceptance": st.spec_accepted_tokens / st.spec_draft_tokens if st.spec_draft_tokens else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="edit,self-repeat,nothing")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (0.5B workloads)")
    ap.add_argument("--new", type=int, default=128, help="new tokens per request / turn (x2 on the tiny model)")
    ap.add_argument("-k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speculative.json"))
    args = ap.parse_args()
    rows = [measure(w, args) for w in args.workloads.split(",")]
    doc = {"cpu": cpu_line(), "threads": args.threads, "k": args.k, "repeats": args.repeats, "rows": rows}
    print(f"CPU: {doc['cpu']}, {args.threads} threads, k={args.k}, median of {args.repeats}")
    print(f"{'workload':<12} {'model':<18} {'off tok/s':>10} {'ngram tok/s':>12} {'ratio':>6} {'accept':>7} identical")
    for r in rows:
        print(f"{r['workload']:<12} {r['model']:<18} {r['tok_s_off']:>10.1f} {r['tok_s_ngram']:>12.1f} "
              f"{r['ratio']:>6.2f} {r['acceptance']:>7.0%} {r['identical_tokens']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
