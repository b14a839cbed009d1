"""`kvserve plan --model DIR` reports exactly what the engine then allocates and logs."""

from __future__ import annotations

import json
import logging

import pytest
from typer.testing import CliRunner

from kvserve.cli import app
from kvserve.engine.llm import LLM

# tests/engine/conftest.py's model by hand: fp32 K and V, 2 layers × 2 KV heads × head_dim 16 × 4 bytes
HAND_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # = 512


@pytest.mark.parametrize("budget, block_size, hand_blocks", [("8MiB", 16, 8 * 2**20 // (512 * 16)),
                                                             ("3MiB", 4, 3 * 2**20 // (512 * 4))])
def test_plan_matches_engine_allocation(tiny_llama, budget, block_size, hand_blocks, caplog):
    result = CliRunner().invoke(app, ["plan", "--model", str(tiny_llama), "--kv-cache-memory", budget,
                                      "--block-size", str(block_size), "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=budget, block_size=block_size)
    cap = llm.engine.capacity
    assert (plan["num_blocks"], plan["token_capacity"], plan["bytes_per_token"]) == (
        cap.num_blocks, cap.token_capacity, cap.bytes_per_token)
    assert plan["engine_log_line"] == cap.summary()
    assert cap.summary() in caplog.text  # the engine logs it at start-up
    assert llm.engine.runner.kv_bytes == cap.allocated_bytes == plan["allocated_bytes"]
    # both equal the figures worked out by hand (1024 and 1536 blocks), not only each other
    assert (cap.bytes_per_token, cap.num_blocks, cap.token_capacity) == (
        HAND_BYTES_PER_TOKEN, hand_blocks, hand_blocks * block_size)
    assert cap.allocated_bytes == hand_blocks * block_size * HAND_BYTES_PER_TOKEN
