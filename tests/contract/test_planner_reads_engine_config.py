"""The planner reads a supported architecture's window through the engine's ModelConfig: a Qwen2
config with ``use_sliding_window`` but no ``max_window_layers`` has no windowed layer (the default
is 28, as in transformers and the engine), so per-sequence KV keeps growing with the sequence."""

from __future__ import annotations

from kvserve.config import ModelConfig
from kvserve.planner.kv_model import build_kv_model
from kvserve.planner.model_spec import spec_from_hf_dict

QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
         "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
         "max_position_embeddings": 32768, "use_sliding_window": True, "sliding_window": 4096, "dtype": "bfloat16"}


def test_default_max_window_layers_means_no_windowed_layer() -> None:
    engine = ModelConfig.from_hf_dict(QWEN2)
    spec = spec_from_hf_dict(QWEN2, "qwen2-window", "test")
    assert engine.sliding_window is None and spec.windowed_layers == 0
    kv = build_kv_model(spec, "bfloat16")
    # hand arithmetic: 2 (K,V) x 24 layers x 2 KV heads x 64 dims x 2 bytes = 12,288 bytes per token,
    # and a 32K-token sequence holds all 32K tokens (no window caps it)
    assert kv.bytes_per_token == 2 * 24 * 2 * 64 * 2 == 12288
    assert kv.sequence_bytes(32768) == 12288 * 32768


def test_every_layer_windowed_when_max_window_layers_is_zero() -> None:
    cfg = {**QWEN2, "max_window_layers": 0}
    engine = ModelConfig.from_hf_dict(cfg)
    spec = spec_from_hf_dict(cfg, "qwen2-window", "test")
    assert engine.sliding_window == 4096 and spec.windowed_layers == 24
    assert build_kv_model(spec, "bfloat16").sequence_bytes(32768) == 12288 * 4096
