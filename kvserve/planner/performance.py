"""Speed limits from bandwidth and FLOPs, cost, and the memory × time a request holds.

Decode is bandwidth-bound: each step reads the weights once (for MoE, the experts the batch
touches) and every running sequence's KV, so

    time per output token ≥ (weights read + batch × KV per sequence) ÷ bandwidth
    tokens/s ≤ batch ÷ that time

Prefill is compute-bound: FLOPs = 2 × matmul parameters × prompt tokens + attention
(2 × heads × (qk_dim + v_dim) per query-key pair, causal, windows honoured), ÷ dense FLOP/s.
Both are lower bounds at 100% of peak; real engines reach some fraction of them. Under tensor
parallelism every GPU reads its 1/tp share in parallel (communication not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner.hardware import HardwareSpec
from kvserve.planner.kv_model import KVModel
from kvserve.planner.model_spec import ModelSpec
from kvserve.planner.params import ParamCount, weights_read_per_step


@dataclass(frozen=True)
class DecodeRow:
    batch: int
    weights_read_bytes: float
    kv_read_bytes: int
    time_per_token_s: float

    @property
    def step_bytes(self) -> float:
        return self.weights_read_bytes + self.kv_read_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.time_per_token_s


@dataclass(frozen=True)
class Perf:
    """Everything speed-related for one model, device and KV setting (per GPU figures)."""

    spec: ModelSpec
    params: ParamCount
    kv: KVModel
    hw: HardwareSpec
    weight_dtype: str
    bytes_per_param: float
    tp: int

    def decode(self, batch: int, context: int) -> DecodeRow | None:
        """The bandwidth bound for ``batch`` sequences of ``context`` tokens; None without bandwidth."""
        if self.hw.bandwidth_bytes_s is None:
            return None
        weights = weights_read_per_step(self.params, self.spec, batch) * self.bytes_per_param / self.tp
        kv = batch * self.kv.sequence_bytes(context)
        return DecodeRow(batch, weights, kv, (weights + kv) / self.hw.bandwidth_bytes_s)

    def prefill_flops(self, prompt: int) -> float:
        """FLOPs to prefill one prompt of ``prompt`` tokens (all GPUs together)."""
        s = self.spec
        lm_head = 0 if s.tie_word_embeddings else self.params.embedding
        matmul_params = self.params.active - self.params.embedding - lm_head
        linear = 2.0 * matmul_params * prompt + 2.0 * s.vocab_size * s.hidden_size  # logits: last token only
        qk = s.head_dim
        v = s.mla.v_head_dim if s.mla else s.head_dim
        per_pair = 2.0 * s.num_attention_heads * (qk + v)
        pairs = 0
        for w in s.layer_windows:
            if w is None or w >= prompt:
                pairs += prompt * (prompt + 1) // 2
            else:  # the first w queries see 1..w keys, the rest see w each
                pairs += w * (w + 1) // 2 + (prompt - w) * w
        return linear + per_pair * pairs

    def prefill_time(self, prompt: int) -> float | None:
        flops = self.hw.dense_flops(self.weight_dtype)
        if flops is None:
            return None
        return self.prefill_flops(prompt) / (flops * self.tp)

    def request_gib_seconds(self, prompt: int, output: int, batch: int) -> float | None:
        """KV memory × time one request holds (all GPUs), running in a batch of ``batch``:
        its prompt's KV during prefill, then ⌈growing⌉ KV for each decode step's duration."""
        if self.hw.bandwidth_bytes_s is None:
            return None
        prefill = self.prefill_time(prompt) or 0.0
        total = self.kv.sequence_bytes(prompt) * prefill
        for i in range(1, output + 1):
            row = self.decode(batch, prompt + i)
            assert row is not None
            total += self.kv.sequence_bytes(prompt + i) * row.time_per_token_s
        return total * self.tp / 2**30


def decode_batches(max_batch: int, extra: int | None = None) -> list[int]:
    """1, 2, 4, … up to ``max_batch``, plus ``max_batch`` and ``extra`` themselves."""
    out = {1}
    b = 2
    while b < max_batch:
        out.add(b)
        b *= 2
    out.add(max(1, max_batch))
    if extra is not None and 1 <= extra <= max_batch:
        out.add(extra)
    return sorted(out)


def cost_per_million_tokens(price_per_hour: float, tp: int, tokens_per_s: float) -> float:
    """Dollars per million output tokens at a throughput ceiling; ``price_per_hour`` is per GPU."""
    return price_per_hour * tp / 3600.0 / tokens_per_s * 1e6
