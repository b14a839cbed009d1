"""The quality curve of KV eviction: what each policy costs at each ratio, through the engine.

Each held-out sequence is split into a context (its first ``context_tokens``, the "prompt" a
policy compresses) and a continuation, fed teacher-forced ``chunk`` tokens per step through the
engine's KV manager and runner (chunks end exactly at the context's end, where SnapKV scores).
After every step the manager applies the request's policy (window drops; SnapKV / H2O read the
block scores the attention computed), exactly as serving does. Per policy and ratio, over the
continuation's positions:

==================  ==========================================================================
``kl``              mean ``KL(p_full ‖ p_evicted)`` (nats)
``delta_ppl_pct``   ``100 × (ppl / ppl_full − 1)``
``kept``            blocks held at the end / blocks full KV holds
``tokens_per_gib``  tokens per GiB of KV held at the end (full KV: ``2^30 / bytes per token``)
``retrieval_accuracy``  None: the retrieval model (issue 15, item 4) is not shipped yet
==================  ==========================================================================

A ratio is the fraction of KV removed (kvpress's count). ``sinks`` at ratio ``r`` keeps 4 sink
tokens and a window of ``(1 - r) × context - 4`` tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.contract import ScheduledChunk, SchedulerOutput
from kvserve.engine.engine import LLMEngine
from kvserve.kv.press import PressSpec
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams

POLICIES = ("sinks", "snapkv", "h2o")


@dataclass(frozen=True)
class Scored:
    logprobs: list[torch.Tensor]  # per sequence, [continuation positions, vocab]
    held_blocks: int              # summed over sequences, at the end


def press_for(name: str, ratio: float, context: int) -> PressSpec | None:
    if name == "none" or ratio == 0.0:
        return None
    if name == "sinks":
        return PressSpec("sinks", sink_tokens=4, window_tokens=max(1, round((1 - ratio) * context) - 4))
    return PressSpec(name, ratio=ratio, sink_tokens=4, recent_tokens=16, observe_tokens=16)


def score(engine: LLMEngine, sequences: Sequence[list[int]], context: int, chunk: int,
          press: PressSpec | None) -> Scored:
    """Teacher-forced log-probabilities of every continuation position under ``press``."""
    kv = engine.kv
    reqs = []
    for i, seq in enumerate(sequences):
        r = Request(f"evict-{i}", list(seq[:context]), SamplingParams(max_tokens=len(seq)), kv_press=press)
        for t in seq[context:]:
            r.append_token(t)
        reqs.append(r)
    out: list[list[torch.Tensor]] = [[] for _ in reqs]
    held = 0
    try:
        while True:
            chunks = []
            for r in reqs:
                left = r.num_tokens - r.num_computed_tokens
                if left <= 0:
                    continue
                start = r.num_computed_tokens
                n = min(chunk, left, context - start) if start < context else min(chunk, left)
                if not kv.allocate_slots(r, n):
                    raise RuntimeError("the eval's KV pool is too small; raise kv_cache_memory")
                window, sinks = kv.window_of(r)
                chunks.append(ScheduledChunk(r.request_id, start, n, r.all_token_ids[start:start + n],
                                             list(kv.block_table(r.request_id)), window=window, sinks=sinks,
                                             score_queries=kv.score_queries(r, start, n)))
            if not chunks:
                break
            logits, scores = engine.runner.score_blocks(  # type: ignore[attr-defined]
                SchedulerOutput(chunks=chunks, block_ops=kv.take_block_ops()))
            row = 0
            for c in chunks:
                r = reqs[int(c.request_id.removeprefix("evict-"))]
                lp = torch.log_softmax(logits[row:row + c.num_new_tokens], -1)
                first = max(0, context - 1 - c.start)  # positions that predict a continuation token
                out[reqs.index(r)].append(lp[first:])
                row += c.num_new_tokens
                r.num_computed_tokens += c.num_new_tokens
                kv.forget(r)
                kv.apply_scores(r, scores.get(r.request_id))
                kv.check()
        held = sum(kv.num_held_blocks(r.request_id) for r in reqs)
    finally:
        for r in reqs:
            r.status = RequestStatus.FINISHED_ABORTED
            kv.free(r)
        engine.runner.execute(SchedulerOutput(finished=[r.request_id for r in reqs]))
    return Scored([torch.cat(p) for p in out], held)


def compare(full: Scored, other: Scored, sequences: Sequence[list[int]], context: int) -> tuple[float, float, float]:
    """(mean KL(full ‖ other), nll full, nll other) over continuation predictions."""
    kl, nll_f, nll_o, count = 0.0, 0.0, 0.0, 0
    for lf, lo, seq in zip(full.logprobs, other.logprobs, sequences):
        targets = torch.tensor(seq[context:])
        lf, lo = lf[:len(targets)], lo[:len(targets)]
        kl += float((lf.exp() * (lf - lo)).sum())
        nll_f -= float(lf.gather(1, targets[:, None]).sum())
        nll_o -= float(lo.gather(1, targets[:, None]).sum())
        count += len(targets)
    return kl / count, nll_f / count, nll_o / count


def curve(engine: LLMEngine, sequences: Sequence[list[int]], policies: Sequence[str], ratios: Sequence[float],
          context: int, chunk: int = 8) -> dict[str, object]:
    """The JSON of ``kvserve eval kv --evict``: ``{"full": {...}, "evict": {POLICY: {RATIO: {...}}}}``."""
    block_bytes = engine.capacity.bytes_per_token * engine.capacity.block_size
    tokens = sum(len(s) for s in sequences)
    full = score(engine, sequences, context, chunk, None)

    def per_gib(held: int) -> float:
        return round(tokens / (held * block_bytes / 2**30))

    _, nll_full, _ = compare(full, full, sequences, context)
    doc: dict[str, object] = {"full": {"retrieval_accuracy": None, "ppl": round(math.exp(nll_full), 4),
                                       "tokens_per_gib": per_gib(full.held_blocks)}, "evict": {}}
    for name in policies:
        rows: dict[str, object] = {}
        for ratio in ratios:
            got = score(engine, sequences, context, chunk, press_for(name, ratio, context))
            kl, _, nll = compare(full, got, sequences, context)
            rows[f"{ratio:g}"] = {"retrieval_accuracy": None, "kl": kl,
                                  "delta_ppl_pct": round(100 * (math.exp(nll - nll_full) - 1), 4),
                                  "kept": round(got.held_blocks / full.held_blocks, 4),
                                  "tokens_per_gib": per_gib(got.held_blocks)}
        doc["evict"][name] = rows  # type: ignore[index]
    return doc


def plot(doc: dict[str, object], path: str) -> None:
    """KL against the ratio removed, one line per policy (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in doc["evict"].items():  # type: ignore[attr-defined]
        xs = [float(r) for r in rows]
        ax.plot(xs, [rows[r]["kl"] for r in rows], "o-", label=name)
    ax.set_xlabel("fraction of KV removed")
    ax.set_ylabel("KL(full ‖ evicted), nats")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
