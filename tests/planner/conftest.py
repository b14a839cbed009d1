"""Shared helpers for the planner tests: a tiny Llama config on disk, and the CLI run in-process
with :func:`kvserve.cli.main`'s error handling (one line on stderr, exit 2)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvserve.planner.__main__ import main


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never touch the real ~/.cache/kvserve from a test."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))


TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def write_config(folder: Path, **overrides: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, **overrides}))
    return folder


@pytest.fixture
def tiny_ckpt(tmp_path: Path) -> Path:
    return write_config(tmp_path / "tiny-llama")


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    """``cli("--model", "x", ...)`` runs ``kvserve plan …`` and returns (exit code, stdout, stderr)."""

    def run(*args: str) -> Result:
        code = 0
        try:
            main(["plan", *args])
        except SystemExit as exc:
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def plan_json(cli, *args: str) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    r = cli(*args, "--json")
    assert r.code == 0, r.err
    data: dict[str, Any] = json.loads(r.out)
    return data
