"""Speculative decoding on and off inside one engine, rounds alternating: tokens/s of one request.

    python benchmarks/spec_ab.py                        # the 0.5B shape, nothing to copy (temperature 1)
    python benchmarks/spec_ab.py --temperature 0        # greedy: the random model's own loops

``benchmarks/speculative.py`` runs two engines one after the other, so a drift of the host lands on
one of them (this session-11 host moved 9-15 tok/s between runs). Here one engine with
``speculative="ngram"`` has its drafter switched off and on (``Scheduler.drafter``) between rounds,
the order reversed every other round; each round decodes ``--steps`` engine steps of the same
request and counts the tokens they produced (a verify can produce several). The issue's target for
text with nothing to copy: at most 5 % slower with drafting on. Prints the CPU, a table and writes
JSON (default ``benchmarks/results/spec_ab.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import CACHE, prompt_ids

from kvserve import LLM, SamplingParams
from kvserve.bench.machine import cpu_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12, help="engine steps per round and variant")
    ap.add_argument("-k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "spec_ab.json")
    a = ap.parse_args()
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}  flags: {' '.join(cpu['flags'])}  threads: {a.threads}")
    llm = LLM(a.model, dtype="bfloat16", kv_cache_memory="1GiB", num_threads=a.threads, speculative="ngram",
              num_speculative_tokens=a.k)
    eng = llm.engine
    drafter = eng.scheduler.drafter
    new = (a.steps + 1) * a.rounds * 2 * (a.k + 1) + 8
    rid = eng.add_request({"prompt_token_ids": prompt_ids(a.context, 7)},
                          SamplingParams(max_tokens=new, temperature=a.temperature, seed=7, ignore_eos=True))
    req = eng.scheduler.requests[rid]
    while not req.output_token_ids:
        eng.step()
    variants = {"ngram": drafter, "off": None}
    tok_s: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(a.rounds):
        for name in (list(variants) if rnd % 2 == 0 else list(variants)[::-1]):
            eng.scheduler.drafter = variants[name]
            eng.step()  # the switch's first step is not timed
            n0, t0 = len(req.output_token_ids), time.perf_counter()
            for _ in range(a.steps):
                eng.step()
            tok_s[name].append((len(req.output_token_ids) - n0) / (time.perf_counter() - t0))
    eng.scheduler.drafter = drafter
    eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    st = drafter.stats if drafter else None
    print(f"\none request, {a.context}-token prompt, temperature {a.temperature}: tokens/s, median of {a.rounds} rounds")
    print(f"  ngram {med['ngram']:.2f}   off {med['off']:.2f}   ratio {med['ngram'] / med['off']:.3f}"
          + (f"   drafts accepted {st.accepted}/{st.proposed}" if st else ""))
    doc = {"cpu": cpu, "command": " ".join(["python", "benchmarks/spec_ab.py", *sys.argv[1:]]),
           "temperature": a.temperature, "context": a.context, "median_tok_s": med, "runs_tok_s": tok_s,
           "ratio": med["ngram"] / med["off"],
           "drafts": {"verifies": st.verifies, "proposed": st.proposed, "accepted": st.accepted} if st else None}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
