"""Model shapes that ``kvserve make-model`` can write as random-weight checkpoints.

The big presets copy the ``config.json`` fields of real models (values and parameter counts from
the project's reference table, checked against the published checkpoints); the ``tiny-*`` ones are
for tests: one per architecture feature, hidden size 64, two layers, a vocabulary that covers the
default tokenizer (1024 ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.config import SUPPORTED_ARCHITECTURES, normalize_dtype

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral",
}


@dataclass(frozen=True)
class ModelPreset:
    """A decoder shape in Hugging Face terms. ``reference_params`` is the published parameter
    count (tied lm_head counted once) where the preset copies a real model."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    dtype: str
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    sliding_window: int | None = None
    reference_params: int | None = None
    source: str = "kvserve test preset"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"preset {self.name}: unsupported architecture {self.architecture!r}")
        normalize_dtype(self.dtype)

    def hf_config(self, dtype: str | None = None, eos_token_ids: tuple[int, ...] = (),
                  bos_token_id: int | None = None) -> dict[str, Any]:
        """``config.json`` contents in the form transformers 5 writes (``rope_parameters``, ``dtype``)."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        arch = self.architecture
        cfg: dict[str, Any] = {
            "architectures": [arch],
            "model_type": _MODEL_TYPES[arch],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": normalize_dtype(dtype or self.dtype),
            "bos_token_id": bos_token_id,
            "eos_token_id": list(eos_token_ids) if len(eos_token_ids) != 1 else eos_token_ids[0],
            "pad_token_id": None,
            "use_cache": True,
        }
        if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
            cfg["attention_bias"] = self.attention_bias
        if arch == "LlamaForCausalLM":
            cfg["mlp_bias"] = False
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            cfg["use_sliding_window"] = False
            cfg["sliding_window"] = None
            cfg["max_window_layers"] = self.num_hidden_layers
        if arch == "MistralForCausalLM":
            cfg["sliding_window"] = self.sliding_window
        cfg.update(self.extra)
        return cfg


def _tiny(name: str, architecture: str, **kw: Any) -> ModelPreset:
    base: dict[str, Any] = {
        "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "dtype": "float32",
    }
    return ModelPreset(name=name, architecture=architecture, **{**base, **kw})


PRESETS: dict[str, ModelPreset] = {p.name: p for p in (
    ModelPreset(
        name="qwen2.5-0.5b", architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, dtype="bfloat16", attention_bias=True,
        reference_params=494032768, source="Qwen/Qwen2.5-0.5B config.json",
    ),
    ModelPreset(
        name="llama-3.2-1b", architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, dtype="bfloat16",
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        reference_params=1235814400, source="meta-llama/Llama-3.2-1B config.json",
    ),
    ModelPreset(
        name="smollm2-135m", architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, dtype="bfloat16",
        reference_params=134515008, source="HuggingFaceTB/SmolLM2-135M config.json",
    ),
    _tiny("tiny-llama", "LlamaForCausalLM", num_key_value_heads=4),
    _tiny("tiny-llama-gqa", "LlamaForCausalLM", num_key_value_heads=2),
    _tiny("tiny-llama-mqa", "LlamaForCausalLM", num_key_value_heads=1),
    _tiny("tiny-llama31", "LlamaForCausalLM", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    _tiny("tiny-qwen2", "Qwen2ForCausalLM", tie_word_embeddings=True, attention_bias=True,
          rope_theta=1000000.0),
    _tiny("tiny-qwen3", "Qwen3ForCausalLM", head_dim=32),
    _tiny("tiny-mistral", "MistralForCausalLM", sliding_window=16),
)}


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; raises ``ValueError`` listing the known presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
