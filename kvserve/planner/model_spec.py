"""What the planner needs to know about a model, read from a ``config.json``-shaped dict.

The engine's :class:`kvserve.config.ModelConfig` covers the Llama family it can run; the planner
also plans for models the engine cannot run (Gemma 2's alternating local/global layers, Mixtral's
experts, DeepSeek-V3's latent attention), so it reads the raw dict itself and keeps the engine's
config alongside when the architecture is one the engine supports. Then the planner's bytes per
token come from the very function the engine uses.

Invariant: ``len(layer_windows) == num_layers``; an entry is the layer's attention window in
tokens, or ``None`` for a global layer that keeps the whole context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.config import SUPPORTED_ARCHITECTURES, ModelConfig, normalize_dtype


@dataclass(frozen=True)
class MLADims:
    """DeepSeek multi-head latent attention widths (``config.json`` names)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None


@dataclass(frozen=True)
class MoEDims:
    """Routed experts: ``num_experts`` per MoE layer, ``experts_per_token`` chosen per token."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    router_bias: bool = False


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str
    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    layer_windows: tuple[int | None, ...]
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    mla: MLADims | None = None
    moe: MoEDims | None = None
    engine_config: ModelConfig | None = None

    def __post_init__(self) -> None:
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"{self.name}: {len(self.layer_windows)} layer windows for {self.num_layers} layers"
            )

    @property
    def attention_kind(self) -> str:
        """``MLA``, ``MHA``, ``MQA`` or ``GQA``."""
        if self.mla is not None:
            return "MLA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def windowed_layers(self) -> int:
        return sum(w is not None for w in self.layer_windows)


def _int_field(cfg: dict[str, Any], key: str, where: str) -> int:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{where} is missing required field {key!r}")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value <= 0:
        raise ValueError(f"{where}: field {key!r} must be a whole number > 0, got {value!r}")
    return int(value)


def _opt_int(cfg: dict[str, Any], key: str, where: str) -> int | None:
    return None if cfg.get(key) is None else _int_field(cfg, key, where)


def _weights_dtype(cfg: dict[str, Any]) -> str:
    quant = cfg.get("quantization_config") or {}
    if str(quant.get("quant_method", "")).lower() == "fp8":
        return "fp8"
    return normalize_dtype(str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"))


def _layer_windows(cfg: dict[str, Any], model_type: str, layers: int, where: str) -> tuple[int | None, ...]:
    window = _opt_int(cfg, "sliding_window", where)
    types = cfg.get("layer_types")
    if window is None:
        return (None,) * layers
    if isinstance(types, list) and len(types) == layers:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if model_type == "gemma2":  # even layers local, odd layers global
        return tuple(window if i % 2 == 0 else None for i in range(layers))
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not cfg.get("use_sliding_window", False):
            return (None,) * layers
        first = int(cfg.get("max_window_layers", 28))  # transformers' default, like the engine's
        return tuple(window if i >= first else None for i in range(layers))
    if model_type == "llama":
        return (None,) * layers
    return (window,) * layers


def _moe(cfg: dict[str, Any], where: str) -> MoEDims | None:
    experts = cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts")
    if not experts:
        return None
    inter = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    return MoEDims(
        num_experts=int(experts),
        experts_per_token=_int_field(cfg, "num_experts_per_tok", where),
        expert_intermediate_size=int(inter or 0),
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        first_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
        router_bias=cfg.get("topk_method") == "noaux_tc",
    )


def spec_from_hf_dict(cfg: dict[str, Any], name: str, source: str) -> ModelSpec:
    """Read a Hugging Face ``config.json`` dict (or a preset entry, which has the same fields).

    Raises ``ValueError`` naming the missing or bad field; a supported architecture is also read
    through :meth:`ModelConfig.from_hf_dict` so the engine's own checks apply.
    """
    where = f"model config {source}"
    if not isinstance(cfg, dict):
        raise ValueError(f"{where} must be a JSON object")  # noqa: TRY004 - a user error, one line
    archs = cfg.get("architectures") or []
    if not archs and not cfg.get("model_type"):
        raise ValueError(f"{where} has neither 'architectures' nor 'model_type'; is this a config.json?")
    arch = str(archs[0]) if archs else str(cfg["model_type"])
    model_type = str(cfg.get("model_type") or "").lower()
    hidden = _int_field(cfg, "hidden_size", where)
    layers = _int_field(cfg, "num_hidden_layers", where)
    heads = _int_field(cfg, "num_attention_heads", where)
    kv_heads = _opt_int(cfg, "num_key_value_heads", where) or heads
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = MLADims(
            kv_lora_rank=_int_field(cfg, "kv_lora_rank", where),
            qk_rope_head_dim=_int_field(cfg, "qk_rope_head_dim", where),
            qk_nope_head_dim=_int_field(cfg, "qk_nope_head_dim", where),
            v_head_dim=_int_field(cfg, "v_head_dim", where),
            q_lora_rank=_opt_int(cfg, "q_lora_rank", where),
        )
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    else:
        head_dim = _opt_int(cfg, "head_dim", where) or hidden // heads
        if heads % kv_heads:
            raise ValueError(
                f"{where}: num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
    if head_dim <= 0:
        raise ValueError(f"{where}: head_dim must be > 0 (hidden_size {hidden} / heads {heads})")
    engine_cfg = ModelConfig.from_hf_dict(cfg) if arch in SUPPORTED_ARCHITECTURES else None
    llama_bias = model_type == "llama" and bool(cfg.get("attention_bias", False))
    return ModelSpec(
        name=name,
        source=source,
        architecture=arch,
        model_type=model_type,
        hidden_size=hidden,
        intermediate_size=_int_field(cfg, "intermediate_size", where),
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_int_field(cfg, "vocab_size", where),
        max_position_embeddings=_opt_int(cfg, "max_position_embeddings", where) or 2048,
        dtype=_weights_dtype(cfg),
        # a supported architecture: the engine's own reading of the window (one source of truth)
        layer_windows=((engine_cfg.sliding_window,) * layers if engine_cfg is not None
                       else _layer_windows(cfg, model_type, layers, where)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("qkv_bias", model_type == "qwen2")) or llama_bias,
        o_bias=llama_bias,
        qk_norm=bool(cfg.get("qk_norm", model_type == "qwen3")),
        norms_per_layer=4 if model_type == "gemma2" else 2,
        mla=mla,
        moe=_moe(cfg, where),
        engine_config=engine_cfg,
    )
