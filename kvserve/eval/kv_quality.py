"""How much a lossy KV codec costs in quality, measured through the engine's own paged path.

For each codec an engine is started with that ``kv_cache_dtype`` (so its storage, byte count and
attention read path are exactly what serving uses) next to a reference engine with full-precision
KV (the model dtype). Both score the same held-out token sequences *teacher-forced*: the runner
computes the logits of every position while the sequences are fed ``chunk`` tokens per step
(default 1: every token attends to the stored — quantized — KV of all earlier tokens, exactly as
in decoding). Per codec:

=====================  ==============================================================
``ppl``                ``exp(mean NLL)`` of the next token over all scored positions
``delta_ppl_pct``      ``100 × (ppl / ppl_ref − 1)``
``kl``                 mean over positions of ``KL(p_ref ‖ p_codec)`` (nats)
``top1_agreement``     share of positions whose argmax equals the reference's
``greedy_agreement``   greedy decoding of ``greedy_tokens`` tokens from held-out prompts: the
                       share of tokens generated before the first difference from the
                       reference (averaged over prompts; 1.0 = identical text)
``bytes_per_token``    the engine's KV bytes per token (scales included), as allocated
=====================  ==============================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.contract import ScheduledChunk, SchedulerOutput
from kvserve.engine.engine import LLMEngine
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams

DEFAULT_CODECS: tuple[str, ...] = ("fp8", "int8", "int4", "k:int8,v:int4")


@dataclass(frozen=True)
class EvalConfig:
    """What to measure. ``texts`` held-out texts, each cut to ``max_tokens`` tokens, are scored;
    ``greedy_prompts`` prompts of ``prompt_tokens`` tokens are continued for ``greedy_tokens``."""

    model: str
    codecs: tuple[str, ...] = DEFAULT_CODECS
    texts: int = 8
    max_tokens: int = 512
    chunk: int = 1
    greedy_prompts: int = 4
    prompt_tokens: int = 64
    greedy_tokens: int = 256
    min_tokens: int = 0
    sink_tokens: int = CacheConfig.kv_quant_sink_tokens
    group_size: int | None = None
    block_size: int = 16
    kv_cache_memory: int = 256 * 2**20
    dtype: str = "auto"
    num_threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("texts", "max_tokens", "chunk", "prompt_tokens", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2 (one token predicts the next), got {self.max_tokens}")
        if self.greedy_prompts < 0 or self.greedy_tokens < 0:
            raise ValueError("greedy_prompts and greedy_tokens must be >= 0")
        if not self.codecs:
            raise ValueError("give at least one codec to evaluate")


@dataclass
class CodecResult:
    ppl: float
    delta_ppl_pct: float
    kl: float
    top1_agreement: float
    greedy_agreement: float | None
    bytes_per_token: int
    window_bytes: int = 0
    tokens_scored: int = 0


@dataclass
class EvalReport:
    model: str
    reference: str
    config: dict[str, object]
    codecs: dict[str, CodecResult] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {"model": self.model, "reference": self.reference, "config": self.config,
                "codecs": {k: asdict(v) for k, v in self.codecs.items()}}


def make_engine(cfg: EvalConfig, codec: str) -> LLMEngine:
    """An engine with ``codec`` KV, no prefix caching (every token is computed and stored by it)."""
    cache = CacheConfig(block_size=cfg.block_size, kv_cache_memory=cfg.kv_cache_memory, kv_cache_dtype=codec,
                        enable_prefix_caching=False, kv_quant_min_tokens=cfg.min_tokens,
                        kv_quant_group_size=cfg.group_size, kv_quant_sink_tokens=cfg.sink_tokens)
    n = max(cfg.texts, cfg.greedy_prompts, 1)
    sched = SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=max(512, n * cfg.chunk),
                            max_model_len=max(cfg.max_tokens, cfg.prompt_tokens + cfg.greedy_tokens) + 1)
    return LLMEngine(EngineConfig(model=cfg.model, dtype=cfg.dtype, cache=cache, scheduler=sched,
                                  num_threads=cfg.num_threads))


def teacher_forced_logprobs(engine: LLMEngine, sequences: Sequence[list[int]], chunk: int = 1) -> list[torch.Tensor]:
    """Log-probabilities ``[len(seq), vocab]`` (float32) at every position of each sequence, fed
    ``chunk`` tokens per step, all sequences batched, through the engine's KV manager and runner."""
    reqs = [Request(f"eval-{i}", list(ids), SamplingParams(max_tokens=1)) for i, ids in enumerate(sequences)]
    out: list[list[torch.Tensor]] = [[] for _ in reqs]
    try:
        while True:
            chunks = []
            for r in reqs:
                n = min(chunk, r.num_tokens - r.num_computed_tokens)
                if n <= 0:
                    continue
                if not engine.kv.allocate_slots(r, n):
                    raise RuntimeError("the eval's KV pool is too small; raise kv_cache_memory")
                start = r.num_computed_tokens
                chunks.append(ScheduledChunk(r.request_id, start, n, r.all_token_ids[start:start + n],
                                             list(engine.kv.block_table(r.request_id))))
            if not chunks:
                break
            logits = engine.runner.score(SchedulerOutput(chunks=chunks, block_ops=engine.kv.take_block_ops()))
            row = 0
            for c in chunks:
                i = int(c.request_id.removeprefix("eval-"))
                out[i].append(torch.log_softmax(logits[row:row + c.num_new_tokens], -1))
                row += c.num_new_tokens
                reqs[i].num_computed_tokens += c.num_new_tokens
    finally:
        for r in reqs:
            r.status = RequestStatus.FINISHED_ABORTED
            engine.kv.free(r)
        engine.runner.execute(SchedulerOutput(finished=[r.request_id for r in reqs]))
    return [torch.cat(parts) for parts in out]


def greedy_continuations(engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``max_tokens`` tokens (EOS ignored), batched through the engine."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    done = {o.request_id: o for o in engine.run_until_done()}
    return [list(done[i].outputs[0].token_ids) for i in ids]


def prefix_agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Share of ``a`` generated before its first difference from ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / len(a) if a else 1.0


@dataclass(frozen=True)
class _Scored:
    logprobs: list[torch.Tensor]
    targets: list[torch.Tensor]

    def nll(self) -> tuple[float, int]:
        total, count = 0.0, 0
        for lp, t in zip(self.logprobs, self.targets):
            total += float(-lp[:-1].gather(1, t[:, None]).sum())
            count += t.numel()
        return total / count, count


def compare(ref: _Scored, other: _Scored) -> tuple[float, float]:
    """(mean KL(ref ‖ other), top-1 agreement) over every predicting position."""
    kl_sum, agree, count = 0.0, 0, 0
    for lr, lo in zip(ref.logprobs, other.logprobs):
        lr, lo = lr[:-1], lo[:-1]
        kl_sum += float((lr.exp() * (lr - lo)).sum())
        agree += int((lr.argmax(-1) == lo.argmax(-1)).sum())
        count += lr.shape[0]
    return kl_sum / count, agree / count


def heldout_tokens(tokenizer: object, n_texts: int, max_tokens: int) -> list[list[int]]:
    """The first ``max_tokens`` tokens of ``n_texts`` evenly spaced held-out texts of the tiny
    model's data set (never trained on)."""
    from kvserve.tiny.eval import heldout_subset

    texts = heldout_subset(n_texts)
    encode = tokenizer.encode  # type: ignore[attr-defined]
    return [list(encode(t, add_special_tokens=False))[:max_tokens] for t in texts]


def run_eval(cfg: EvalConfig, log: Callable[[str], None] = lambda s: None,
             sequences: Sequence[list[int]] | None = None) -> EvalReport:
    """Score the reference and every codec; ``sequences`` defaults to the held-out texts."""
    ref_engine = make_engine(cfg, "auto")
    reference = ref_engine.kv_dtype
    if sequences is None:
        sequences = heldout_tokens(ref_engine.tokenizer, cfg.texts, cfg.max_tokens)
    sequences = [s for s in sequences if len(s) >= 2]
    prompts = [s[:cfg.prompt_tokens] for s in sequences[:cfg.greedy_prompts]]
    targets = [torch.tensor(s[1:]) for s in sequences]

    def measure(engine: LLMEngine) -> tuple[_Scored, list[list[int]]]:
        scored = _Scored(teacher_forced_logprobs(engine, sequences, cfg.chunk), targets)
        greedy = greedy_continuations(engine, prompts, cfg.greedy_tokens) if prompts and cfg.greedy_tokens else []
        return scored, greedy

    log(f"reference ({reference}): scoring {sum(len(s) for s in sequences)} tokens in {len(sequences)} texts")
    ref, ref_greedy = measure(ref_engine)
    ref_nll, count = ref.nll()
    report = EvalReport(cfg.model, reference, {k: v for k, v in asdict(cfg).items() if k != "model"})
    report.codecs[reference] = CodecResult(math.exp(ref_nll), 0.0, 0.0, 1.0, 1.0 if ref_greedy else None,
                                           ref_engine.capacity.bytes_per_token, 0, count)
    del ref_engine
    for codec in cfg.codecs:
        engine = make_engine(cfg, codec)
        if engine.runner.kv_bytes != engine.capacity.allocated_bytes:
            raise RuntimeError(f"{codec}: storage holds {engine.runner.kv_bytes} bytes, capacity says "
                               f"{engine.capacity.allocated_bytes}")
        log(f"{engine.kv_dtype}: {engine.capacity.summary()}")
        scored, greedy = measure(engine)
        nll, _ = scored.nll()
        kl, top1 = compare(ref, scored)
        agree = (sum(prefix_agreement(g, r) for g, r in zip(greedy, ref_greedy)) / len(greedy)) if greedy else None
        ppl = math.exp(nll)
        report.codecs[engine.kv_dtype] = CodecResult(
            ppl, 100.0 * (ppl / math.exp(ref_nll) - 1.0), kl, top1, agree, engine.capacity.bytes_per_token,
            engine.capacity.window_bytes, count)
    return report


def format_table(report: EvalReport) -> str:
    """A fixed-width table of the report, one row per codec, the reference first."""
    head = f"{'codec':<16} {'ppl':>8} {'Δppl %':>8} {'KL (nats)':>10} {'top-1':>7} {'greedy':>7} {'B/token':>8}"
    lines = [head, "-" * len(head)]
    for name, r in report.codecs.items():
        greedy = "-" if r.greedy_agreement is None else f"{r.greedy_agreement:.3f}"
        lines.append(f"{name:<16} {r.ppl:>8.3f} {r.delta_ppl_pct:>+8.3f} {r.kl:>10.2e} {r.top1_agreement:>7.4f} "
                     f"{greedy:>7} {r.bytes_per_token:>8}")
    return "\n".join(lines)
