"""The Llama family in one file: Llama (incl. 3.1 rope scaling), Qwen2, Qwen3 and Mistral.

All four are the same decoder; a config decides the differences:

=====================  ==========================================================
Llama                  plain; optional ``attention_bias`` on q/k/v/o
Qwen2                  bias on q/k/v (always), none on o; usually tied embeddings
Qwen3                  RMSNorm per head on q and k before rope; explicit head_dim
Mistral                sliding-window attention on every layer
=====================  ==========================================================

MHA / GQA / MQA are ``num_key_value_heads`` == / < / 1 × ``num_attention_heads``.

Tokens of every scheduled sequence arrive packed into one flat batch ``[T]`` (no padding, no
batch dimension); attention reads each sequence's context through the paged KV cache
(:mod:`kvserve.model.attention`). The checkpoint's q/k/v projections are fused into one
``qkv_proj`` and gate/up into one ``gate_up_proj`` at load time (one matmul instead of three/two);
:meth:`LlamaForCausalLM.packed_modules` tells the loader how to concatenate them.

Numerics follow transformers: RMSNorm in float32 then cast back, rope cos/sin computed in float32
and cast to the model dtype, residual adds in the model dtype. On CPU, half-precision models run
each projection on the GEMM path measured fastest for this machine and row count
(:mod:`kvserve.model.gemm_plan`, applied by the loader): same values up to fp32 summation order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig
from kvserve.kv.layer_kv import LayerKV
from kvserve.model import decode_stack
from kvserve.model.attention import AttentionMetadata, paged_attention
from kvserve.model.rope import RotaryEmbedding
from kvserve.model.row_blocks import in_row_blocks
from kvserve.native import fused


def qkv_has_bias(config: ModelConfig) -> bool:
    """Qwen2 always has q/k/v bias; Llama and Qwen3 follow ``attention_bias``; Mistral never."""
    if config.architecture == "Qwen2ForCausalLM":
        return True
    return config.attention_bias and config.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM")


def o_has_bias(config: ModelConfig) -> bool:
    """Only Llama and Qwen3 put a bias on the output projection, and only with ``attention_bias``."""
    return config.attention_bias and config.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM")


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))``, the normalisation in float32, the product in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(residual + x), residual + x)`` in one pass (:func:`kvserve.native.fused.add_rms_norm`)."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_has_bias(config))
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_has_bias(config))
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        """x ``[T, hidden]``; cos/sin ``[T, head_dim]`` -> ``[T, hidden]``. Writes this step's K/V."""
        t, h = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x).view(t, -1, self.head_dim)           # [T, H + 2*KVH, D]
        fused_qkv = getattr(meta.backend, "forward_qkv", None)       # rope + K/V write + read, fused
        if fused_qkv is not None and self.q_norm is None:
            o = fused_qkv(qkv, cos, sin, kv_cache, meta, self.scale, h)
            if o is not None:
                return self.o_proj(o.reshape(t, self.q_size))
        qk, v = qkv.split([h + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        qk = fused.rotary(qk, cos, sin)                               # q and k heads rotated together
        q, k = qk.split([h, self.num_kv_heads], dim=1)                # [T, H, D], [T, KVH, D]
        if meta.backend is not None:
            o = meta.backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T, H, D]
        else:
            o = paged_attention(q, k, v, kv_cache, meta, self.scale)

        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    """SiLU-gated MLP: ``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_row_blocks(self._rows, x)                           # a prompt's rows 512 at a time

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)                                # [T, 2 * I]: gate, up
        return self.down_proj(fused.silu_mul(gate_up, self.intermediate_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        normed, h = self.post_attention_layernorm.add_forward(a, h)   # h + a, and its norm, in one pass
        return h + self.mlp(normed)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder over a paged KV cache.

    ``forward`` takes the flat packed tokens of one engine step and returns their final hidden
    states; ``compute_logits`` projects only the rows the sampler needs. Parameter names are the
    checkpoint's, except the fused ``qkv_proj`` / ``gate_up_proj`` (see :meth:`packed_modules`);
    with tied embeddings there is no ``lm_head`` and the embedding matrix projects the logits.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # The logits projection; None with tied embeddings (the embedding matrix projects).
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def packed_modules(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Fused module -> its checkpoint modules and their output rows, in concatenation order."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        return {
            "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
            "gate_up_proj": (("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size)),
        }

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[LayerKV | torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions ``[T]`` int64; ``kv_caches[i]`` is layer i's
        ``[2, num_blocks, block_size, kv_heads, head_dim]``. Returns hidden states ``[T, hidden]``.

        The K/V of these tokens are written into the caches at ``meta.slot_mapping``. A model with a
        sliding window (Mistral) applies it whatever the runner put in ``meta.sliding_window``.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} KV caches (one per layer), got {len(kv_caches)}")
        window = self.config.sliding_window
        if window is not None and meta.sliding_window != window:
            meta = dataclasses.replace(meta, sliding_window=window)
        h = self.model.embed_tokens(input_ids)                        # [T, hidden]
        cos, sin = self.model.rotary_emb(positions, h.dtype)          # [T, D] each
        stacked = decode_stack.run_layers(self, h, cos, sin, kv_caches, meta)  # a small step: one native call
        if stacked is not None:
            return self.model.norm(stacked)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer(h, cos, sin, kv_cache, meta)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` float32."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    def pack_cpu_fp16_gemm(self) -> int:
        """Run every projection (and the logits) through FBGEMM's fp16-weight GEMM
        (:mod:`kvserve.model.cpu_gemm`), whatever the machine: the loader instead applies the
        plan measured for this machine (:mod:`kvserve.model.gemm_plan`). A tied logits projection
        gets its own packed copy (the embedding stays for lookups). Returns the roles' modules
        swapped."""
        from kvserve.model.gemm_apply import apply_plan
        from kvserve.model.gemm_plan import uniform

        return apply_plan(self, uniform("fbgemm_fp16", "forced"))
