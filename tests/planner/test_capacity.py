"""The ledger and the pool: agreement with the engine's sizing, concurrency and context limits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import CacheConfig, ModelConfig, parse_size
from kvserve.engine.memory import kv_capacity
from kvserve.kv.layout import capacity_for_budget, model_kv_bytes_per_token, resolve_kv_dtype
from kvserve.planner.capacity import DoesNotFit, max_context, max_sequences
from kvserve.planner.inputs import PlanRequest
from kvserve.planner.kv_model import build_kv_model
from kvserve.planner.loader import load_model
from kvserve.planner.plan import build_plan

from .conftest import plan_json


def hand_bytes_per_token(kv_dtype: str, block: int) -> int:
    """conftest's TINY_LLAMA by hand: 2 layers × 2 KV heads × (K + V bytes per head), head_dim 16."""
    if kv_dtype in ("auto", "bf16", "fp16"):  # the model is bf16: 2 bytes per element
        per_head = 2 * (16 * 2)
    elif kv_dtype in ("fp8", "int8"):         # 1 byte per element + a 4-byte scale per token and head
        per_head = 2 * (16 + 4)
    else:                                     # int4: K 8 bytes + scales 4 × 16 / group; V 8 + 4
        group = min(32, block)
        per_head = (8 + 4 * 16 // group) + (8 + 4)
    return 2 * 2 * per_head


def hand_num_blocks(kv_dtype: str, budget: int, block: int) -> int:
    """int4 sets 64 sequences × 3 full-precision (bf16, 256 B/token) blocks aside first."""
    window = 64 * 3 * block * 256 if kv_dtype == "int4" else 0
    return (budget - window) // (hand_bytes_per_token(kv_dtype, block) * block)


@pytest.mark.parametrize("kv_dtype", ["auto", "bf16", "fp16", "fp8", "int8", "int4"])
@pytest.mark.parametrize("budget,block", [("4GiB", 16), ("1MiB", 4), ("123457", 8)])
def test_planner_pool_equals_engine_sizing(
    cli,
    tiny_ckpt: Path,
    kv_dtype: str,
    budget: str,  # type: ignore[no-untyped-def]
    block: int,
) -> None:
    args = ("--model", str(tiny_ckpt), "--kv-cache-memory", budget, "--kv-dtype", kv_dtype,
            "--block-size", str(block), "--max-model-len", "512", "--max-num-seqs", "64")
    engine_cfg = ModelConfig.from_path(tiny_ckpt)
    # The engine's own sizing (a lossy codec sets its full-precision window aside first).
    cache = CacheConfig(block_size=block, kv_cache_memory=parse_size(budget), kv_cache_dtype=kv_dtype)
    try:
        cap = kv_capacity(engine_cfg, cache, resolve_kv_dtype(kv_dtype, engine_cfg.dtype), 512,
                          torch.device("cpu"), 64)
    except ValueError as exc:  # the engine cannot start: neither may the plan
        r = cli(*args, "--json")
        assert r.code == 2 and "window" in str(exc) and "window" in r.err
        assert hand_num_blocks(kv_dtype, parse_size(budget), block) <= 0
        return
    d = plan_json(cli, *args)
    per_token = model_kv_bytes_per_token(engine_cfg, kv_dtype, block)  # exact for this block size
    assert d["bytes_per_token"] == per_token == cap.bytes_per_token
    assert d["num_blocks"] == cap.num_blocks
    assert d["token_capacity"] == cap.token_capacity
    assert d["max_concurrency_at_max_len"] == cap.max_concurrency_at_max_len
    # and both equal figures worked out by hand, not through the shared functions
    assert d["bytes_per_token"] == hand_bytes_per_token(kv_dtype, block)
    assert d["num_blocks"] == hand_num_blocks(kv_dtype, parse_size(budget), block)
    assert d["token_capacity"] == d["num_blocks"] * block
    assert d["max_concurrency_at_max_len"] == d["num_blocks"] / (512 // block)


def test_hand_figures_for_the_tiny_model() -> None:
    """The hand arithmetic above, spelt out for a few cases a reader can check on paper."""
    assert hand_bytes_per_token("auto", 16) == 256 and hand_bytes_per_token("int8", 4) == 160
    assert [hand_bytes_per_token("int4", b) for b in (4, 8, 16, 32)] == [144, 112, 96, 88]
    assert hand_num_blocks("auto", 4 * 2**30, 16) == 2**20
    assert hand_num_blocks("int4", 2**20, 4) == (2**20 - 196_608) // 576 == 1479


def test_transformers_written_config_agrees(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """A config.json as transformers 5 writes it (``rope_parameters``, ``dtype``); head_dim ≠ hidden/heads."""
    import transformers
    cfg = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=300,
        max_position_embeddings=1024,
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.save_pretrained(tmp_path / "qwen3")
    d = plan_json(cli, "--model", str(tmp_path / "qwen3"), "--kv-cache-memory", "64MiB", "--kv-dtype", "int8")
    per_token = model_kv_bytes_per_token(ModelConfig.from_path(tmp_path / "qwen3"), "int8")
    assert per_token == 2 * 3 * 2 * (32 + 4)
    cap = capacity_for_budget(64 * 2**20, per_token, 16, 1024)
    assert (d["bytes_per_token"], d["num_blocks"], d["token_capacity"]) == (
        per_token,
        cap.num_blocks,
        cap.token_capacity,
    )
    assert d["num_blocks"] == 64 * 2**20 // (432 * 16) == 9709  # by hand: 432 B/token, blocks of 16


def test_ledger_from_hardware(cli) -> None:  # type: ignore[no-untyped-def]
    d = plan_json(
        cli, "--model", "llama-3.1-8b", "--hardware", "h100", "--reserve", "10%", "--utilization", "0.8"
    )
    led = d["ledger"]
    usable = 81559 * 2**20  # nvidia-smi's figure, not the "80 GB" label
    assert led["usable_bytes"] == usable
    assert led["usable_x_utilization_bytes"] == int(usable * 0.8)
    assert led["reserve_bytes"] == int(int(usable * 0.8) * 0.1)
    assert led["weights_bytes_per_gpu"] == 8_030_261_248 * 2
    assert (
        led["kv_budget_bytes"]
        == led["usable_x_utilization_bytes"] - led["weights_bytes_per_gpu"] - led["reserve_bytes"]
    )
    assert d["num_blocks"] == led["kv_budget_bytes"] // (131072 * 16)


def test_fixed_reserve_bytes(cli) -> None:  # type: ignore[no-untyped-def]
    d = plan_json(cli, "--model", "llama-3.1-8b", "--memory", "80GiB", "--reserve", "4GiB")
    assert d["ledger"]["reserve_bytes"] == 4 * 2**30


def test_model_that_cannot_fit_says_by_how_much() -> None:
    with pytest.raises(
        DoesNotFit, match=r"llama-3.1-70b cannot fit on H100 SXM5 80GB: .* by 7[0-9]\.\d\d GiB"
    ):
        build_plan(PlanRequest(model="llama-3.1-70b", hardware="h100"))
    plan = build_plan(PlanRequest(model="llama-3.1-70b", hardware="h100", tp="4"))
    assert plan.ledger.weights_per_gpu == -(-70_553_706_496 * 2 // 4)


def test_budget_smaller_than_one_block_is_reported(tiny_ckpt: Path) -> None:
    with pytest.raises(DoesNotFit, match="smaller than one block"):
        build_plan(PlanRequest(model=str(tiny_ckpt), kv_cache_memory="100"))


@settings(max_examples=60, deadline=None)
@given(
    budget=st.integers(1, 2**36),
    concurrency=st.integers(1, 300),
    block=st.sampled_from([1, 4, 16, 32]),
    model=st.sampled_from(["llama-3-8b", "gemma-2-9b", "deepseek-v3"]),
)
def test_max_context_is_the_largest_that_fits(budget: int, concurrency: int, block: int, model: str) -> None:
    kv = build_kv_model(load_model(model), "bfloat16")
    t = max_context(budget, kv, concurrency, block)
    assert t is not None
    assert concurrency * kv.sequence_block_bytes(t, block) <= budget
    assert concurrency * kv.sequence_block_bytes(t + 1, block) > budget
    if t > 0:
        assert max_sequences(budget, kv, t, block) >= concurrency


def test_uniform_model_concurrency_is_blocks_over_blocks_per_sequence() -> None:
    kv = build_kv_model(load_model("llama-3-8b"), "bfloat16")
    budget = 56 * 2**30
    blocks = budget // (131072 * 16)
    for t in (1000, 4096, 131072):
        assert max_sequences(budget, kv, t, 16) == blocks // -(-t // 16)
    assert max_context(budget, kv, 32, 16) == (blocks // 32) * 16


def test_all_windowed_model_has_unbounded_context(cli) -> None:  # type: ignore[no-untyped-def]
    d = plan_json(cli, "--model", "mistral-7b-v0.1", "--kv-cache-memory", "8GiB", "--concurrency", "4")
    assert d["max_context_at_concurrency"] == {"concurrency": 4, "tokens": None}
    assert any("sliding window" in n for n in d["notes"])


def test_window_override_changes_concurrency_not_pool(cli, tiny_ckpt: Path) -> None:  # type: ignore[no-untyped-def]
    base = plan_json(cli, "--model", "llama-3-8b", "--kv-cache-memory", "16GiB", "--max-model-len", "32K")
    windowed = plan_json(
        cli,
        "--model",
        "llama-3-8b",
        "--kv-cache-memory",
        "16GiB",
        "--max-model-len",
        "32K",
        "--sliding-window",
        "4K",
    )
    assert windowed["num_blocks"] == base["num_blocks"]
    # 16 GiB = 8192 blocks of 16 × 128 KiB; 32K tokens hold 2048 blocks, a 4K window spans at
    # most ceil(4095 / 16) + 1 = 257 (the one it straddles): 4 sequences vs 31
    assert base["fit"]["full_length_sequences"] == 8192 // 2048
    assert windowed["fit"]["full_length_sequences"] == 8192 // 257


def test_scenario_is_written_into_settings(cli) -> None:  # type: ignore[no-untyped-def]
    d = plan_json(cli, "--model", "llama-3-8b", "--hardware", "a100", "--scenario", "long-doc-qa")
    s = d["settings"]
    assert s["kv_dtype"]["value"] == "int8" and s["kv_dtype"]["source"] == "scenario long-doc-qa"
    assert s["reserve"]["value"] == 0.3 and "30%" in s["reserve"]["reason"]
    # the model has 8,192 positions: the scenario's 32K is capped, and says so
    assert s["max_model_len"]["value"] == 8192 and "capped" in s["max_model_len"]["reason"]
    assert d["block_size"] == 32
