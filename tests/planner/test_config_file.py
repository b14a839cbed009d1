"""``--write-config`` and :func:`kvserve.config_file.load_engine_config`: round trip and validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_size
from kvserve.config_file import DeploymentExtras, load_engine_config, read_config_file, write_config_file
from kvserve.kv.layout import capacity_for_budget, model_kv_bytes_per_token

from .conftest import plan_json


def test_write_config_round_trip(cli, tiny_ckpt: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "conf" / "engine.json"
    d = plan_json(
        cli,
        "--model",
        str(tiny_ckpt),
        "--memory",
        "2GiB",
        "--scenario",
        "multi-turn",
        "--write-config",
        str(out),
    )
    cf = read_config_file(out)
    e = cf.engine
    assert e.model == str(tiny_ckpt.resolve())
    assert e.dtype == "bfloat16"
    assert e.cache.kv_cache_memory == d["ledger"]["kv_budget_bytes"]
    assert (e.cache.block_size, e.cache.kv_cache_dtype) == (16, "int8")
    assert (e.scheduler.max_num_seqs, e.scheduler.max_num_batched_tokens, e.scheduler.max_model_len) == (
        64,
        4096,
        512,
    )
    assert e.cache.enable_prefix_caching is True
    assert cf.extras.session_idle_timeout_s == 600
    assert cf.extras.sliding_window == 8192
    assert cf.extras.scenario == "multi-turn"
    # The engine sizing the written budget gets exactly the plan's pool.
    cap = capacity_for_budget(
        e.cache.kv_cache_memory,
        model_kv_bytes_per_token(ModelConfig.from_path(e.model), e.cache.kv_cache_dtype),
        e.cache.block_size,
        e.scheduler.max_model_len or 512,
    )
    assert (cap.num_blocks, cap.token_capacity) == (d["num_blocks"], d["token_capacity"])
    # by hand: int8 on the tiny model is 2 × 2 layers × 2 KV heads × (16 + 4) = 160 B/token, no window
    assert d["num_blocks"] == e.cache.kv_cache_memory // (160 * 16)
    assert d["token_capacity"] == d["num_blocks"] * 16
    assert load_engine_config(out) == e


def test_preset_writes_the_hub_repo(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "c.json"
    plan_json(cli, "--model", "llama-3.1-8b", "--hardware", "l40s", "--write-config", str(out))
    assert load_engine_config(out).model == "meta-llama/Llama-3.1-8B"


def test_round_trip_of_every_field(tmp_path: Path) -> None:
    engine = EngineConfig(
        model="m",
        dtype="float16",
        device="cpu",
        seed=3,
        num_threads=2,
        cache=CacheConfig(
            block_size=32, kv_cache_memory=123456, kv_cache_dtype="int4", enable_prefix_caching=False
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=3, max_num_batched_tokens=99, max_model_len=77, enable_chunked_prefill=False
        ),
    )
    extras = DeploymentExtras(
        session_idle_timeout_s=5,
        sliding_window=64,
        reserve_bytes=9,
        utilization=0.5,
        tensor_parallel=1,
        hardware="cpu",
        scenario=None,
    )
    p = write_config_file(tmp_path / "x.json", engine, extras)
    cf = read_config_file(p)
    assert cf.engine == engine and cf.extras == extras


def _write(tmp_path: Path, data: object) -> Path:
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(data))
    return p


@pytest.mark.parametrize(
    "data,message",
    [
        ({"model": "m", "colour": 1}, "unknown key 'colour'"),
        ({"model": "m", "cache": {"block_sise": 16}}, r"cache: unknown key 'block_sise'; valid: block_size"),
        ({"model": "m", "scheduler": {"max_seqs": 4}}, "scheduler: unknown key 'max_seqs'"),
        ({"model": "m", "extras": {"prefix_caching": True}}, "extras: unknown key 'prefix_caching'"),
        ({"cache": {}}, "missing required key 'model'"),
        ({"model": "m", "cache": {"block_size": "16"}}, r"cache.block_size: expected"),
        ({"model": "m", "cache": {"block_size": 24}}, "block_size must be a power of two"),
        ({"model": "m", "scheduler": {"max_num_seqs": 0}}, "max_num_seqs must be > 0"),
        ({"model": "m", "scheduler": {"enable_chunked_prefill": 1}}, "enable_chunked_prefill: expected"),
        ({"model": "m", "extras": {"utilization": 1.5}}, r"utilization must be in \(0, 1\]"),
        ({"model": "m", "cache": []}, "cache must be a JSON object"),
        (["model"], "must hold a JSON object"),
    ],
)
def test_bad_config_files(tmp_path: Path, data: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_engine_config(_write(tmp_path, data))


def test_size_strings_and_missing_file(tmp_path: Path) -> None:
    e = load_engine_config(_write(tmp_path, {"model": "m", "cache": {"kv_cache_memory": "4GiB"}}))
    assert e.cache.kv_cache_memory == parse_size("4GiB")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_engine_config(tmp_path / "nope.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_engine_config(tmp_path / "broken.json")


def test_engine_sizes_the_written_config_as_planned(cli, tiny_ckpt: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """plan → --write-config → load_engine_config → the engine's own pool sizing: same blocks."""
    import torch

    from kvserve.engine import memory
    from kvserve.kv.layout import resolve_kv_dtype

    hand_bpt = {"auto": 256, "int8": 160, "int4": 96}  # 2 × 2 layers × 2 KV heads × bytes per head, blocks of 16

    for kv in ("auto", "int8", "int4"):
        out = tmp_path / f"{kv}.json"
        d = plan_json(
            cli, "--model", str(tiny_ckpt), "--memory", "1GiB", "--kv-dtype", kv, "--write-config", str(out)
        )
        e = load_engine_config(out)
        model_cfg = ModelConfig.from_path(e.model)
        cap = memory.kv_capacity(
            model_cfg,
            e.cache,
            resolve_kv_dtype(e.cache.kv_cache_dtype, model_cfg.dtype),
            e.scheduler.max_model_len,
            torch.device("cpu"),
            e.scheduler.max_num_seqs,  # sizes a lossy codec's full-precision window
        )
        assert (cap.num_blocks, cap.token_capacity, cap.bytes_per_token) == (
            d["num_blocks"],
            d["token_capacity"],
            d["bytes_per_token"],
        )
        assert e.cache.block_size == 16 and d["bytes_per_token"] == hand_bpt[kv]
        window = e.scheduler.max_num_seqs * 3 * 16 * 256 if kv == "int4" else 0  # int4: 3 bf16 blocks a sequence
        assert d["num_blocks"] == (e.cache.kv_cache_memory - window) // (hand_bpt[kv] * 16)
