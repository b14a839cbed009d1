"""Every bad input: one clear line on stderr and a non-zero exit code (2, as ``kvserve.cli.main``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import TINY_LLAMA, write_config

BAD = [
    (
        ["--model", "lama-3-8b", "--kv-cache-memory", "1GiB"],
        "unknown model preset 'lama-3-8b'; did you mean llama-3-8b",
    ),
    (["--model", "llama-3-8b", "--hardware", "h1000"], "unknown hardware preset 'h1000'; did you mean"),
    (["--model", "llama-3-8b", "--hardware", "h100", "--scenario", "chat"], "unknown scenario 'chat'"),
    (["--model", "./missing/config.json"], "no such file or folder"),
    (["--model", "llama-3-8b", "--memory", "0"], "memory size must be > 0"),
    (["--model", "llama-3-8b", "--memory", "-80GiB"], "--memory: cannot read memory size '-80GiB'"),
    (["--model", "llama-3-8b", "--kv-cache-memory", "0GiB"], "--kv-cache-memory: memory size must be > 0"),
    (
        ["--model", "llama-3-8b", "--memory", "80GiB", "--utilization", "0"],
        r"--utilization must be in (0, 1]",
    ),
    (
        ["--model", "llama-3-8b", "--memory", "80GiB", "--utilization", "1.5"],
        r"--utilization must be in (0, 1]",
    ),
    (
        ["--model", "llama-3-8b", "--memory", "80GiB", "--utilization", "-0.2"],
        r"--utilization must be in (0, 1]",
    ),
    (
        ["--model", "llama-3-8b", "--memory", "80GiB", "--utilization", "lots"],
        "--utilization must be a number",
    ),
    (["--model", "llama-3-8b", "--memory", "80GiB", "--reserve", "1.2"], r"--reserve must be in [0, 1)"),
    (["--model", "llama-3-8b", "--memory", "80GiB", "--block-size", "0"], "--block-size must be > 0"),
    (["--model", "llama-3-8b", "--memory", "80GiB", "--block-size", "-16"], "--block-size must be > 0"),
    (
        ["--model", "llama-3-8b", "--memory", "80GiB", "--block-size", "24"],
        "--block-size must be a power of two",
    ),
    (
        ["--model", "llama-3-8b", "--memory", "80GiB", "--block-size", "big"],
        "--block-size must be a whole number",
    ),
    (["--model", "llama-3-8b", "--memory", "80GiB", "--max-model-len", "0"], "--max-model-len must be > 0"),
    (["--model", "llama-3-8b", "--memory", "80GiB", "--max-num-seqs", "-1"], "--max-num-seqs must be > 0"),
    (["--model", "llama-3-8b", "--memory", "80GiB", "--concurrency", "0"], "--concurrency must be > 0"),
    (["--model", "llama-3-8b", "--memory", "80GiB", "--tp", "0"], "--tp must be > 0"),
    (["--model", "llama-3-8b", "--memory", "80GiB", "--tp", "3"], "--tp 3 must divide num_attention_heads"),
    (["--model", "llama-3-8b", "--memory", "80GiB", "--kv-dtype", "int3"], "unknown KV dtype 'int3'"),
    (["--model", "llama-3-8b", "--memory", "80GiB", "--dtype", "int2"], "unknown weight dtype 'int2'"),
    (["--model", "llama-3-8b", "--memory", "80GiB", "--bandwidth", "fast"], "--bandwidth must look like"),
    (
        ["--model", "llama-3-8b", "--memory", "80GiB", "--price-per-hour", "-2"],
        "--price-per-hour must be > 0",
    ),
    (["--model", "llama-3-8b", "--memory", "80GiB", "--sliding-window", "0"], "--sliding-window must be > 0"),
    (
        ["--model", "llama-3-8b", "--memory", "80GiB", "--json", "--markdown"],
        "choose one of --json and --markdown",
    ),
    (
        ["--model", "llama-3.1-70b", "--hardware", "h100"],
        "llama-3.1-70b cannot fit on H100 SXM5 80GB: weights 131.42 GiB",
    ),
    (["--model", "llama-3-8b", "--kv-cache-memory", "1000"], "is smaller than one block"),
    (["--model", "llama-3-8b", "--memory", "80GiB", "--compare", "kv_dtype"], "--compare must look like"),
    (
        ["--model", "llama-3-8b", "--memory", "80GiB", "--compare", "kv_dtype=int8"],
        "give at least two values",
    ),
    (
        ["--model", "llama-3-8b", "--memory", "80GiB", "--compare", "colour=a,b"],
        "--compare: unknown input 'colour'",
    ),
    (
        ["--model", "llama-3-8b", "--memory", "80GiB", "--compare", "kv_dtype=bf16,int3"],
        "unknown KV dtype 'int3'",
    ),
    (
        ["--model", "gemma-2-9b", "--hardware", "h100", "--write-config", "/tmp/never.json"],
        "the kvserve engine does not run Gemma2ForCausalLM",
    ),
    ([], "--model is required"),
    (["--model", "llama-3-8b", "--hardware", "h100", "--price-input", "cheap"], "--price-input must be a number"),
    (["--model", "llama-3-8b", "--hardware", "h100", "--price-output", "-1"], "price_output must be a number >= 0"),
    (["--model", "llama-3-8b", "--hardware", "h100", "--price-input", "1", "--cached-fraction", "1.5"],
     "--cached-fraction must be in [0, 1)"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) or "nothing" for a, _ in BAD])
def test_bad_input_is_one_clear_line(cli, args: list[str], message: str) -> None:  # type: ignore[no-untyped-def]
    r = cli(*args)
    assert r.code == 2, (r.code, r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("kvserve: error: ")
    assert message in lines[0], lines[0]
    assert r.out == ""


@pytest.mark.parametrize(
    "content,message",
    [
        ("{not json", "is not valid JSON"),
        (
            json.dumps({**TINY_LLAMA, "num_hidden_layers": 0}),
            "field 'num_hidden_layers' must be a whole number > 0",
        ),
        (json.dumps({**TINY_LLAMA, "hidden_size": -64}), "field 'hidden_size' must be a whole number > 0"),
        (
            json.dumps({k: v for k, v in TINY_LLAMA.items() if k != "vocab_size"}),
            "missing required field 'vocab_size'",
        ),
        (
            json.dumps({**TINY_LLAMA, "num_key_value_heads": 3}),
            "must be a multiple of num_key_value_heads (3)",
        ),
        (json.dumps({"hidden_size": 64}), "has neither 'architectures' nor 'model_type'"),
        (json.dumps([1, 2]), "must be a JSON object"),
    ],
)
def test_malformed_config(cli, tmp_path: Path, content: str, message: str) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "config.json").write_text(content)
    r = cli("--model", str(folder), "--kv-cache-memory", "1GiB")
    assert r.code == 2
    assert len(r.err.strip().splitlines()) == 1
    assert message in r.err


def test_folder_without_config(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    r = cli("--model", str(tmp_path), "--kv-cache-memory", "1GiB")
    assert r.code == 2 and "no config.json in" in r.err


def test_unknown_option_is_rejected(cli, tiny_ckpt: Path) -> None:  # type: ignore[no-untyped-def]
    r = cli("--model", str(write_config(tiny_ckpt)), "--kv-cache-memory", "1GiB", "--colour", "red")
    assert r.code == 2 and "No such option" in r.err
