"""``kvserve plan --model NAME`` without hardware prints the model's KV cost instead of an error."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvserve.cli import app


def test_plan_without_hardware_prints_bytes_per_token_and_tables() -> None:
    r = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    # 2 (K,V) x 32 layers x 8 KV heads x 128 head_dim x 2 bytes (bf16)
    assert data["bytes_per_token"] == 2 * 32 * 8 * 128 * 2 and "32 layers" in data["formula"]
    assert data["kv_bytes_per_sequence"]["4096"] == 4096 * data["bytes_per_token"]
    assert data["kv_bytes_per_batch"]["8x131072"] == 8 * 131072 * data["bytes_per_token"]
    assert data["hardware"] is None


def test_plan_without_hardware_as_text_says_what_to_add() -> None:
    r = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", "--kv-dtype", "int8", "--markdown"])
    assert r.exit_code == 0, r.output
    assert "bytes per token" in r.output and "--hardware" in r.output and "KV per batch" in r.output
