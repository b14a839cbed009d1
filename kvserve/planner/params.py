"""Parameter counts from a model's shape, layer by layer, and what the weights weigh.

The counts follow the reference data's rule: every weight counted once (a tied ``lm_head`` is not
counted twice). For the shipped presets they equal the published checkpoint counts (a test checks
every preset). ``active`` is what one token touches: the shared parts plus ``experts_per_token``
routed experts per MoE layer, embeddings included.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner.model_spec import ModelSpec

# Bytes per weight. int4 counts one fp16 scale per group of 128 weights (4 + 16/128 bits).
WEIGHT_DTYPE_BYTES: dict[str, float] = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5 + 2 / 128,
}
_WEIGHT_ALIASES = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float": "float32",
    "e4m3": "fp8",
}


def resolve_weight_dtype(name: str, model_dtype: str) -> str:
    """Canonical weight dtype; ``auto`` is the dtype the checkpoint is stored in."""
    key = name.strip().lower().removeprefix("torch.")
    key = model_dtype if key == "auto" else _WEIGHT_ALIASES.get(key, key)
    if key not in WEIGHT_DTYPE_BYTES:
        raise ValueError(f"unknown weight dtype {name!r}; valid: auto, {', '.join(WEIGHT_DTYPE_BYTES)}")
    return key


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int
    embedding: int
    routed_expert: int  # all routed experts' weights (0 for a dense model)


def _attention(s: ModelSpec) -> int:
    h = s.hidden_size
    if s.mla is not None:
        m = s.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * s.num_attention_heads * qk
        else:
            q = h * s.num_attention_heads * qk
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv += m.kv_lora_rank * s.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + s.num_attention_heads * m.v_head_dim * h
    q_width = s.num_attention_heads * s.head_dim
    kv_width = s.num_kv_heads * s.head_dim
    n = h * q_width + 2 * h * kv_width + q_width * h
    if s.qkv_bias:
        n += q_width + 2 * kv_width
    if s.o_bias:
        n += h
    if s.qk_norm:
        n += 2 * s.head_dim
    return n


def _mlp(hidden: int, inter: int) -> int:
    return 3 * hidden * inter  # gate, up and down projections


def count_parameters(s: ModelSpec) -> ParamCount:
    """Exact weight count of a decoder with ``s``'s shape."""
    h = s.hidden_size
    embedding = s.vocab_size * h
    lm_head = 0 if s.tie_word_embeddings else embedding
    per_layer_common = _attention(s) + s.norms_per_layer * h
    dense_layer = per_layer_common + _mlp(h, s.intermediate_size)
    if s.moe is None:
        total = s.num_layers * dense_layer + h + embedding + lm_head
        return ParamCount(total, total, embedding, 0)
    m = s.moe
    expert = _mlp(h, m.expert_intermediate_size)
    router = h * m.num_experts + (m.num_experts if m.router_bias else 0)
    moe_layers = s.num_layers - m.first_dense_layers
    moe_layer = per_layer_common + router + (m.num_experts + m.num_shared_experts) * expert
    total = m.first_dense_layers * dense_layer + moe_layers * moe_layer + h + embedding + lm_head
    unused = moe_layers * (m.num_experts - m.experts_per_token) * expert
    return ParamCount(total, total - unused, embedding, moe_layers * m.num_experts * expert)


def weights_bytes(params: int, weight_dtype: str) -> int:
    """Bytes the weights occupy at ``weight_dtype`` (rounded up)."""
    return int(-(-params * WEIGHT_DTYPE_BYTES[weight_dtype] // 1))


def weights_read_per_step(p: ParamCount, s: ModelSpec, batch: int) -> float:
    """Parameters one decode step reads for ``batch`` sequences.

    Dense: all of them. MoE: the shared part plus the routed experts that at least one of the
    batch's tokens picks; with uniform routing a given expert is missed by all ``batch`` tokens with
    probability (1 − k/E)^batch, so the expected share read is 1 − (1 − k/E)^batch.
    """
    if s.moe is None or p.routed_expert == 0:
        return float(p.total)
    k, e = s.moe.experts_per_token, s.moe.num_experts
    touched = 1.0 - (1.0 - k / e) ** batch
    return (p.total - p.routed_expert) + p.routed_expert * touched
