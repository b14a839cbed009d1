"""What each KV eviction policy costs on the shipped chat model: greedy agreement with full KV and
the KV a sequence holds at its peak, through the engine (batch of every prompt at once, chunked
prefill and the prefix cache on).

    .venv/bin/python -m benchmarks.evict_agreement --json benchmarks/results/evict-agreement.json

Per policy: ``agreement`` = mean share of the continuation generated before the first token that
differs from full KV's (1.0 = identical), ``match`` = share of positions with the same token,
``kept`` = peak blocks held by the batch / peak blocks held with full KV, ``tokens_per_gib`` =
tokens in the batch's sequences per GiB of KV held at the peak.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvserve.engine.llm import LLM, resolve_model_path
from kvserve.eval.kv_quality import heldout_tokens, prefix_agreement
from kvserve.sampling_params import SamplingParams

POLICIES = ("none", "sinks:4,188", "snapkv:0.5", "h2o:0.5", "snapkv:0.75", "h2o:0.75")


def run(llm: LLM, prompts: list[list[int]], new: int, press: str | None) -> tuple[list[list[int]], int]:
    engine = llm.engine
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params, kv_press=press) for p in prompts]
    done, peak = {}, 0
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.kv.check()
        peak = max(peak, engine.kv.usage().used)
    engine.kv.reset_prefix_cache()  # the next policy starts cold
    return [list(done[i].outputs[0].token_ids) for i in ids], peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=384)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    llm = LLM(resolve_model_path(None), block_size=16, kv_cache_memory="256MiB", max_num_batched_tokens=512)
    prompts = heldout_tokens(llm.tokenizer, a.prompts, a.prompt_tokens)
    bytes_per_block = llm.engine.capacity.bytes_per_token * 16
    tokens = sum(len(p) for p in prompts) + a.new * len(prompts)
    ref, ref_peak = run(llm, prompts, a.new, None)
    out = {"model": "kvserve-tiny-chat", "prompts": len(prompts), "prompt_tokens": a.prompt_tokens, "new": a.new,
           "policies": {}}
    for name in POLICIES:
        got, peak = (ref, ref_peak) if name == "none" else run(llm, prompts, a.new, name)
        agree = sum(prefix_agreement(g, r) for g, r in zip(got, ref)) / len(ref)
        match = sum(x == y for g, r in zip(got, ref) for x, y in zip(g, r)) / sum(len(r) for r in ref)
        out["policies"][name] = {"agreement": round(agree, 4), "match": round(match, 4),
                                 "kept": round(peak / ref_peak, 4),
                                 "tokens_per_gib": round(tokens / (peak * bytes_per_block / 2**30))}
        print(name, out["policies"][name], flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
