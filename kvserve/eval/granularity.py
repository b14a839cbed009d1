"""Token-level against block-level eviction, measured on the retrieval model.

kvserve's importance policies drop whole blocks (docs/eviction.md says why). This measures what
that coarseness costs: one criterion (SnapKV's: the attention the context's last ``observe``
queries pay each key, summed over heads, queries and layers; ``sinks`` first and ``recent`` last
tokens always kept) choosing single tokens, or choosing blocks of ``block_size`` tokens by their
summed score, keeping the same number of tokens; then the retrieval accuracy each choice leaves.

A reference computation in transformers (eager attention, a 4-D boolean mask), not the engine:
the engine has no token-level path to compare with. The kept KV is the one computed with full
attention (SnapKV compresses after the prefill); the queried key, which arrives after the
context (:mod:`kvserve.eval.retrieval`), and its answer see only what was kept.

    python -m kvserve.eval.granularity --json benchmarks/results/evict-granularity.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from kvserve.eval import retrieval_task as rt
from kvserve.eval.retrieval import load_heldout, shipped_retrieval_model


@torch.no_grad()
def token_scores(model, ids: torch.Tensor, context: int, observe: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``[batch, context]``: attention of the context's last ``observe`` queries on each key."""
    out = model(input_ids=ids[:, :context], output_attentions=True)
    return sum(a[:, :, context - observe:, :].sum(dim=(1, 2)) for a in out.attentions)  # type: ignore[return-value]


def keep_mask(scores: torch.Tensor, kept_tokens: int, sinks: int, recent: int, block_size: int | None) -> torch.Tensor:
    """``[context]`` bools: the ``kept_tokens`` a policy keeps (``block_size`` None: any tokens;
    else whole blocks, ``kept_tokens // block_size`` of them)."""
    n = scores.shape[0]
    if block_size is None:
        s = scores.clone()
        s[:sinks] = s[n - recent:] = float("inf")
        keep = torch.zeros(n, dtype=torch.bool)
        keep[s.topk(min(n, kept_tokens)).indices] = True
        return keep
    blocks = -(-n // block_size)
    s = torch.zeros(blocks).index_add_(0, torch.arange(n) // block_size, scores)
    s[:-(-sinks // block_size)] = float("inf")
    s[(n - recent) // block_size:] = float("inf")
    chosen = s.topk(min(blocks, max(1, kept_tokens // block_size))).indices
    return torch.isin(torch.arange(n) // block_size, chosen)


@torch.no_grad()
def answer(model, ids: torch.Tensor, context: int, keep: torch.Tensor) -> int:  # type: ignore[no-untyped-def]
    """The argmax answer at the last position when queries from ``context`` on see only ``keep``."""
    n = ids.shape[1]
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    seen = torch.cat([keep, torch.ones(n - context, dtype=torch.bool)])[None, :]
    allowed = (k <= q) & ((q < context) | seen)
    return int(model(input_ids=ids, attention_mask=allowed[None, None]).logits[0, -1].argmax())


def measure(model_dir: Path, examples: Sequence[rt.Example], ratios: Sequence[float], block_size: int = 16,
            observe: int = 16, sinks: int = 4, recent: int = 16) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    # eager returns attention weights (for the scores); sdpa honours a boolean 4-D mask (eager
    # would add it to the logits as 0/1, masking nothing)
    eager = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    context = len(examples[0].prompt) - 1
    rows: dict[str, dict[str, float]] = {}
    hits: dict[tuple[float, str], int] = {}
    for i in range(0, len(examples), 8):
        part = examples[i:i + 8]
        ids = torch.tensor([ex.prompt for ex in part])
        scores = token_scores(eager, ids, context, observe)
        for j, ex in enumerate(part):  # the floor: only the sinks and the recent tokens kept
            floor = keep_mask(scores[j], sinks + recent, sinks, recent, None)
            hits[(1.0, "floor")] = hits.get((1.0, "floor"), 0) + int(answer(model, ids[j:j + 1], context, floor) == ex.answer)
        for ratio in ratios:
            budget = (round((1 - ratio) * context) // block_size) * block_size
            for gran, bs in (("token", None), ("block", block_size)):
                for j, ex in enumerate(part):
                    keep = keep_mask(scores[j], budget, sinks, recent, bs)
                    got = answer(model, ids[j:j + 1], context, keep)
                    hits[(ratio, gran)] = hits.get((ratio, gran), 0) + int(got == ex.answer)
    for ratio in ratios:
        rows[f"{ratio:g}"] = {g: round(hits[(ratio, g)] / len(examples), 4) for g in ("token", "block")}
    return {"criterion": f"snapkv (observe {observe}, sinks {sinks}, recent {recent}), question-agnostic",
            "block_size": block_size, "examples": len(examples), "retrieval_accuracy": rows,
            "only_sinks_and_recent_kept": round(hits[(1.0, "floor")] / len(examples), 4),
            "chance": rt.CHANCE}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="retrieval model folder (default: the shipped one)")
    p.add_argument("--examples", type=int, default=64)
    p.add_argument("--ratios", default="0.5,0.75,0.875")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    model = a.model or shipped_retrieval_model()
    if model is None:
        print("error: no retrieval model (pass --model)", file=sys.stderr)
        return 2
    from kvserve.bench.machine import cpu_info

    doc = measure(model, load_heldout(model, a.examples), [float(r) for r in a.ratios.split(",")], a.block_size)
    doc["machine"] = cpu_info()
    doc["command"] = "python -m kvserve.eval.granularity " + " ".join(sys.argv[1:] if argv is None else argv)
    text = json.dumps(doc, indent=1)
    print(text)
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
