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
``retrieval_accuracy``  share of the retrieval model's held-out prompts answered right under the
                    policy (:mod:`kvserve.eval.retrieval`; None without that model)
``retrieval_kept``  blocks the retrieval engine held at the end / blocks full KV holds
==================  ==========================================================================

Quantization and eviction stack: a :class:`Target` is a KV codec; every KL and ΔPPL is against
full-precision, full KV, and the retrieval model runs under the same codec as the chat model.

A ratio is the fraction of KV removed (kvpress's count). ``sinks`` at ratio ``r`` keeps 4 sink
tokens and a window of ``(1 - r) × context - 4`` tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvserve.contract import ScheduledChunk, SchedulerOutput
from kvserve.engine.engine import LLMEngine
from kvserve.eval import retrieval_task as rt
from kvserve.eval.retrieval import RetrievalSet, answers
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
          press: PressSpec | None, drops: Sequence[Sequence[int]] | None = None) -> Scored:
    """Teacher-forced log-probabilities of every continuation position under ``press``.
    ``drops[i]``: logical blocks of sequence ``i`` given back as soon as they are full (a forced
    eviction: no later query reads them)."""
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
                if drops is not None:
                    i = reqs.index(r)
                    due = [b for b in drops[i] if (b + 1) * kv.block_size <= r.num_computed_tokens]
                    kv.drop_blocks(r, [b for b in due if kv.block_table(r.request_id)[b] is not None])
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


@dataclass(frozen=True)
class Target:
    """One KV codec under test: the chat engine (KL, ΔPPL, tokens/GiB) and, when the retrieval
    model is in the run, a retrieval set whose engine stores KV with the same codec."""

    chat: LLMEngine
    retrieval: RetrievalSet | None = None

    @property
    def codec(self) -> str:
        return self.chat.kv_dtype


def _per_gib(engine: LLMEngine, tokens: int, held: int) -> float:
    return round(tokens / (held * engine.capacity.bytes_per_token * engine.capacity.block_size / 2**30))


def _retrieval(rs: RetrievalSet | None, name: str, ratio: float, chunk: int) -> dict[str, object]:
    if rs is None:
        return {"retrieval_accuracy": None}
    predicted, held = answers(rs, press_for(name, ratio, rs.context), chunk)
    full_blocks = len(rs.examples) * -(-(rs.context + 2) // rs.engine.kv.block_size)
    return {"retrieval_accuracy": round(rt.accuracy(predicted, rs.examples), 4),
            "retrieval_kept": round(held / full_blocks, 4)}


def curve(ref: Target, sequences: Sequence[list[int]], policies: Sequence[str], ratios: Sequence[float],
          context: int, chunk: int = 8, targets: Sequence[Target] | None = None,
          log: Callable[[str], None] = lambda s: None) -> dict[str, object]:
    """The JSON of ``kvserve eval kv --evict``: ``{"full": {...}, "evict": {POLICY: {RATIO: {...}}}}``.

    ``ref`` is full-precision KV (the reference of every KL and ΔPPL); ``targets`` (default
    ``[ref]``) are the codecs each policy runs under: a policy under a lossy codec is keyed
    ``POLICY+CODEC`` and the codec alone (no eviction) is reported under ``"codecs"``, so the
    figures of quantization and eviction stacked are measured against the same reference."""
    tokens = sum(len(s) for s in sequences)
    full = score(ref.chat, sequences, context, chunk, None)
    _, nll_full, _ = compare(full, full, sequences, context)
    doc: dict[str, object] = {"full": {"kv_cache_dtype": ref.codec, **_retrieval(ref.retrieval, "none", 0.0, chunk),
                                       "retrieval_chance": rt.CHANCE if ref.retrieval else None,
                                       "ppl": round(math.exp(nll_full), 4),
                                       "tokens_per_gib": _per_gib(ref.chat, tokens, full.held_blocks)},
                              "evict": {}, "codecs": {}}

    def row(t: Target, name: str, ratio: float) -> dict[str, object]:
        got = score(t.chat, sequences, context, chunk, press_for(name, ratio, context))
        kl, _, nll = compare(full, got, sequences, context)
        return {**_retrieval(t.retrieval, name, ratio, chunk), "kl": kl,
                "delta_ppl_pct": round(100 * (math.exp(nll - nll_full) - 1), 4),
                "kept": round(got.held_blocks / full.held_blocks, 4),
                "tokens_per_gib": _per_gib(t.chat, tokens, got.held_blocks), "kv_cache_dtype": t.codec}

    for t in targets or [ref]:
        suffix = "" if t.codec == ref.codec else f"+{t.codec}"
        if suffix:
            doc["codecs"][t.codec] = row(t, "none", 0.0)  # type: ignore[index]
        for name in policies:
            rows: dict[str, object] = {}
            for r in ratios:
                t0 = time.monotonic()
                rows[f"{r:g}"] = row(t, name, r)
                log(f"{name}{suffix} {r:g}: {rows[f'{r:g}']} ({time.monotonic() - t0:.0f} s)")
            doc["evict"][name + suffix] = rows  # type: ignore[index]
    return doc


def plot(doc: dict[str, object], path: str) -> None:
    """Two panels against the ratio removed, one line per policy: the chat model's KL, and the
    retrieval model's accuracy beside its full-KV accuracy and chance (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = doc["full"]
    has_retrieval = full.get("retrieval_accuracy") is not None  # type: ignore[attr-defined]
    fig, axes = plt.subplots(1, 2 if has_retrieval else 1, figsize=(11 if has_retrieval else 6, 4), squeeze=False)
    kl_ax = axes[0][0]
    for name, rows in doc["evict"].items():  # type: ignore[attr-defined]
        xs = [float(r) for r in rows]
        style = "o--" if "+" in name else "o-"
        kl_ax.plot(xs, [max(rows[r]["kl"], 1e-6) for r in rows], style, label=name)
        if has_retrieval:
            axes[0][1].plot(xs, [rows[r]["retrieval_accuracy"] for r in rows], style, label=name)
    kl_ax.set_xlabel("fraction of KV removed")
    kl_ax.set_ylabel("chat model: KL(full ‖ evicted), nats")
    kl_ax.set_yscale("log")
    kl_ax.legend(fontsize=8)
    kl_ax.grid(alpha=0.3)
    if has_retrieval:
        ax = axes[0][1]
        ax.axhline(full["retrieval_accuracy"], color="k", lw=1, label="full KV")  # type: ignore[index]
        ax.axhline(full["retrieval_chance"], color="gray", lw=1, ls=":", label="chance")  # type: ignore[index]
        ax.set_xlabel("fraction of KV removed")
        ax.set_ylabel("retrieval model: accuracy")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
