"""Bytes per token and per sequence: the formulas, every preset, and agreement with the engine's function."""

from __future__ import annotations

import pytest

from kvserve.config import ModelConfig
from kvserve.kv.layout import (
    int4_scale_bytes,
    kv_bytes_per_token,
    mla_kv_bytes_per_token,
    model_kv_bytes_per_token,
)
from kvserve.planner.kv_model import build_kv_model, kv_heads_per_gpu
from kvserve.planner.loader import load_model
from kvserve.planner.model_spec import spec_from_hf_dict
from kvserve.planner.presets import model_presets

from .conftest import TINY_LLAMA


@pytest.mark.parametrize("name", sorted(model_presets()))
def test_every_preset_matches_reference_bf16_bytes_per_token(name: str) -> None:
    entry = model_presets()[name]
    kv = build_kv_model(load_model(name), "bfloat16")
    assert kv.bytes_per_token == entry["kv_cache"]["bytes_per_token_bf16"]


@pytest.mark.parametrize(
    "name",
    [
        k
        for k, v in model_presets().items()
        if v["architectures"][0]
        in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
    ],
)
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16", "fp8", "int8", "int4"])
def test_engine_models_use_the_engines_function(name: str, kv_dtype: str) -> None:
    spec = load_model(name)
    assert spec.engine_config is not None
    engine = model_kv_bytes_per_token(ModelConfig.from_hf_dict(model_presets()[name]), kv_dtype)
    kv = build_kv_model(spec, kv_dtype)
    assert kv.bytes_per_token == engine
    assert sum(g.bytes_per_token for g in kv.groups) == engine


def test_gqa_formula_and_codec_scales() -> None:
    # Llama-3-8B: 2 × 32 × 8 × 128 × 2 = 131072; int8 stores a 4-byte scale per token per head.
    assert kv_bytes_per_token(32, 8, 128, "bf16") == 131072
    assert kv_bytes_per_token(32, 8, 128, "int8") == 2 * 32 * 8 * (128 + 4)
    assert kv_bytes_per_token(32, 8, 128, "fp8") == 2 * 32 * 8 * (128 + 4)
    assert kv_bytes_per_token(32, 8, 128, "int4") == 2 * 32 * 8 * (64 + int4_scale_bytes(128))
    spec = load_model("llama-3-8b")
    assert (
        "2 (K,V) × 32 layers × 8 KV heads × 128 × 2 bytes = 131,072"
        in build_kv_model(spec, "bfloat16").formula
    )
    assert "4 B scales" in build_kv_model(spec, "int8").formula


def test_mqa_and_mha_read_from_num_key_value_heads() -> None:
    mqa = spec_from_hf_dict({**TINY_LLAMA, "num_key_value_heads": 1}, "mqa", "test")
    mha = spec_from_hf_dict(
        {k: v for k, v in TINY_LLAMA.items() if k != "num_key_value_heads"}, "mha", "test"
    )
    assert (mqa.attention_kind, mha.attention_kind) == ("MQA", "MHA")
    assert build_kv_model(mqa, "bfloat16").bytes_per_token == 2 * 2 * 1 * 16 * 2
    assert build_kv_model(mha, "bfloat16").bytes_per_token == 2 * 2 * 4 * 16 * 2


def test_mla_latent_formula_deepseek_v3() -> None:
    spec = load_model("deepseek-v3")
    assert spec.attention_kind == "MLA"
    kv = build_kv_model(spec, "bfloat16")
    assert kv.bytes_per_token == (512 + 64) * 61 * 2 == 70272
    assert kv.formula.startswith("(512 kv_lora_rank + 64 qk_rope_head_dim) × 61 layers × 2 bytes")
    assert mla_kv_bytes_per_token(61, 512, 64, "int8") == 61 * (576 + 4)
    # The latent is replicated, not split, under tensor parallelism.
    assert build_kv_model(spec, "bfloat16", tp=8).bytes_per_token == 70272


def test_gemma2_alternating_windows_match_the_reference_note() -> None:
    kv = build_kv_model(load_model("gemma-2-9b"), "bfloat16")
    assert [(g.num_layers, g.window) for g in kv.groups] == [(21, None), (21, 4096)]
    for t in (100, 4096, 8192, 131072):
        # models.json: 2 × 8 × 256 × 2 × (21 × T + 21 × min(T, 4096)) bytes
        assert kv.sequence_bytes(t) == 2 * 8 * 256 * 2 * (21 * t + 21 * min(t, 4096))


def test_mistral_window_caps_every_layer() -> None:
    kv = build_kv_model(load_model("mistral-7b-v0.1"), "bfloat16")
    assert kv.bounded
    assert kv.sequence_bytes(131072) == kv.sequence_bytes(4096) == 4096 * 131072


def test_window_cap_option_bounds_a_global_model() -> None:
    spec = load_model("llama-3-8b")
    kv = build_kv_model(spec, "bfloat16", window_cap=8192)
    assert kv.sequence_bytes(100_000) == 8192 * 131072
    assert kv.bytes_per_token == 131072  # the pool's per-token cost does not change


def test_tensor_parallel_splits_kv_heads() -> None:
    spec = load_model("llama-3-8b")
    assert kv_heads_per_gpu(spec, 2) == 4
    assert kv_heads_per_gpu(spec, 16) == 1  # replicated when tp > kv heads
    assert build_kv_model(spec, "bfloat16", tp=4).bytes_per_token == 131072 // 4
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        kv_heads_per_gpu(spec, 3)


def test_block_rounding_per_sequence() -> None:
    kv = build_kv_model(load_model("llama-3-8b"), "bfloat16")
    assert kv.sequence_block_bytes(17, 16) == 32 * 131072
    assert kv.sequence_block_bytes(16, 16) == 16 * 131072
