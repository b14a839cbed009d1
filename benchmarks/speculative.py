"""Speculative decoding: single-stream tokens/s with and without, in one run.

Methods (``--methods``, engines built the same way, run alternating, median of ``--repeats``; the
outputs are checked token for token equal to ``off``'s):

* ``off`` — no drafts;
* ``ngram`` — drafts by n-gram lookup in the request's and session's own tokens;
* ``draft`` — drafts from a draft model: the target's first ``--draft-layers`` layers with its
  embedding, final norm and logits projection (an early-exit, "self-speculative" draft, written
  once to ``benchmarks/.cache/<model>-exit<N>``; no download). It shares the tokenizer by
  construction; how often it agrees with the full model is what the run measures.

Workloads:

* ``edit`` — a code-editing chat session on the embedded trained model (kvserve-tiny-chat): turn 1
  asks for a function, the next turns ask for the same function with a change; the model repeats
  most of its previous answer. Tokens/s of the edit turns (turn 2 on).
* ``self-repeat`` — the 0.5B shape (random weights), greedy: such a model falls into loops of its
  own, so what it writes repeats what it wrote (a stand-in for repetitive output on this shape).
* ``nothing`` — the 0.5B shape, sampled at temperature 1 with a seed: a random model's near-flat
  distribution over 151k tokens repeats nothing, so drafts are almost never found (the cost of
  looking, and of the few wrong verifies).

    python benchmarks/speculative.py                 # all three, off and ngram, ~6 min on 2 cores
    python benchmarks/speculative.py --workloads edit --repeats 5
    python benchmarks/speculative.py --methods off,ngram,draft --draft-layers 2
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


def early_exit_draft(model: Path, layers: int) -> Path:
    """``model``'s first ``layers`` layers, its embedding, final norm and logits projection, as a
    checkpoint of its own (written once, beside the model)."""
    out = ROOT / "benchmarks" / ".cache" / f"{model.name}-exit{layers}"
    if (out / "model.safetensors").exists():
        return out
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((model / "config.json").read_text())
    if layers >= cfg["num_hidden_layers"]:
        raise SystemExit(f"--draft-layers {layers} must be below the model's {cfg['num_hidden_layers']} layers")
    cfg["num_hidden_layers"] = layers
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model / name).exists():
            (out / name).write_bytes((model / name).read_bytes())
    keep = {k: t for f in sorted(model.glob("*.safetensors")) for k, t in load_file(f).items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    tiny = name == "edit"
    model = TINY if tiny else SHAPE
    kw: dict[str, Any] = {"kv_cache_memory": "512MiB", "num_threads": args.threads, "block_size": 16}
    methods = args.methods.split(",")
    engines = {}
    for m in methods:
        extra = {"draft_model": early_exit_draft(model, args.draft_layers)} if m == "draft" else {}
        engines[m] = LLM(model, speculative=None if m == "off" else m, num_speculative_tokens=args.k, **kw, **extra)
    new = (args.new // 2 if args.quick else args.new) * (2 if tiny else 1)
    runs: dict[str, list[float]] = {m: [] for m in methods}
    same = True
    for r in range(args.repeats):
        outs = {}
        for mode, llm in engines.items():
            if tiny:
                n, dt, toks = edit_session(llm, f"s{r}", new)
            else:
                n, dt, toks = one_request(llm, r + 1, args.prompt, new, 0.0 if name == "self-repeat" else 1.0)
            runs[mode].append(n / dt)
            outs[mode] = toks
        same = same and all(o == outs[methods[0]] for o in outs.values())
    row: dict[str, Any] = {"workload": name, "model": model.name, "runs": runs, "identical_tokens": same}
    base = median(runs[methods[0]])
    for m in methods:
        row[f"tok_s_{m}"] = median(runs[m])
        row[f"ratio_{m}"] = median(runs[m]) / base
        if m != "off":
            st = engines[m].engine.stats()
            row[f"acceptance_{m}"] = st.spec_accepted_tokens / st.spec_draft_tokens if st.spec_draft_tokens else 0.0
            row[f"verifies_{m}"], row[f"draft_tokens_{m}"] = st.spec_verifies, st.spec_draft_tokens
            row[f"accepted_tokens_{m}"] = st.spec_accepted_tokens
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="edit,self-repeat,nothing")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (0.5B workloads)")
    ap.add_argument("--new", type=int, default=128, help="new tokens per request / turn (x2 on the tiny model)")
    ap.add_argument("-k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--methods", default="off,ngram", help="comma list of off, ngram, draft (the first is the base)")
    ap.add_argument("--draft-layers", type=int, default=2, help="layers of the early-exit draft model (method draft)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speculative.json"))
    args = ap.parse_args()
    rows = [measure(w, args) for w in args.workloads.split(",")]
    methods = args.methods.split(",")
    doc = {"cpu": cpu_line(), "threads": args.threads, "k": args.k, "repeats": args.repeats, "methods": methods,
           "draft_layers": args.draft_layers if "draft" in methods else None, "rows": rows}
    print(f"CPU: {doc['cpu']}, {args.threads} threads, k={args.k}, median of {args.repeats}"
          + (f", draft = first {args.draft_layers} layers" if "draft" in methods else ""))
    print(f"{'workload':<12} {'model':<18} {'method':<7} {'tok/s':>7} {'ratio':>6} {'accept':>7}")
    for r in rows:
        for m in methods:
            acc = f"{r[f'acceptance_{m}']:>7.0%}" if m != "off" else f"{'':>7}"
            print(f"{r['workload']:<12} {r['model']:<18} {m:<7} {r[f'tok_s_{m}']:>7.1f} {r[f'ratio_{m}']:>6.2f} {acc}")
        print(f"{'':<12} identical tokens: {r['identical_tokens']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
