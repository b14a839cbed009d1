"""``kvserve plan`` outputs: table, JSON, markdown, compare, list, plot, check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import plan_json


def test_default_table_names_every_section(cli) -> None:  # type: ignore[no-untyped-def]
    r = cli(
        "--model",
        "qwen2.5-7b",
        "--hardware",
        "a100-40gb",
        "--scenario",
        "short-chat",
        "--price-per-hour",
        "2",
    )
    assert r.code == 0, r.err
    for title in (
        "Model and KV cost",
        "Memory ledger",
        "KV per sequence and concurrency",
        "Does it fit?",
        "Decode lower bound",
        "A typical request",
        "Settings",
    ):
        assert title in r.out
    assert "57,344 B/token" in r.out
    assert "GiB" in r.out and "GB" in r.out
    assert "prefix_caching" in r.out and "system prompt" in r.out  # a scenario reason is printed


def test_json_exposes_engine_figures(cli, tiny_ckpt: Path) -> None:  # type: ignore[no-untyped-def]
    d = plan_json(cli, "--model", str(tiny_ckpt), "--kv-cache-memory", "4GiB")
    for key in (
        "num_blocks",
        "token_capacity",
        "bytes_per_token",
        "kv_formula",
        "ledger",
        "fit",
        "kv_per_sequence",
    ):
        assert key in d
    assert d["model"]["engine_supported"] is True
    assert [r["tokens"] for r in d["kv_per_sequence"]] == [512, 1024, 2048, 4096, 8192, 16384, 32768, 131072]


def test_markdown_tables(cli) -> None:  # type: ignore[no-untyped-def]
    r = cli("--model", "llama-3-8b", "--kv-cache-memory", "10GiB", "--markdown")
    assert r.code == 0
    assert "### Memory ledger" in r.out
    assert "| context | KV GiB | KV GB |" in r.out
    assert "| 8K | 1.00 | 1.07 |" in r.out


def test_compare_kv_dtypes(cli) -> None:  # type: ignore[no-untyped-def]
    r = cli("--model", "llama-3-8b", "--hardware", "h100", "--compare", "kv_dtype=bf16,int8,int4",
            "--block-size", "32", "--json")
    assert r.code == 0, r.err
    d = json.loads(r.out)
    assert d["compare"] == "kv_dtype"
    caps = {v["value"]: v["plan"]["token_capacity"] for v in d["variants"]}
    assert caps["bf16"] < caps["int8"] < caps["int4"]
    assert 1.9 < caps["int8"] / caps["bf16"] < 2.0  # the scale bytes keep it under 2×
    # int4 groups of 32 keys (block 32); the int4 full-precision window costs ~1.5% of the budget.
    assert 3.35 < caps["int4"] / caps["bf16"] < 3.5
    r16 = cli("--model", "llama-3-8b", "--hardware", "h100", "--kv-dtype", "int4", "--block-size", "16", "--json")
    ratio16 = json.loads(r16.out)["token_capacity"] / caps["bf16"]
    assert 3.0 < ratio16 < caps["int4"] / caps["bf16"]  # groups of 16: twice the key scales
    table = cli("--model", "llama-3-8b", "--hardware", "h100", "--compare", "kv-dtype=bf16,int8")
    assert "kv-dtype=bf16" in table.out and "token capacity" in table.out


def test_compare_shows_a_variant_that_does_not_fit(cli) -> None:  # type: ignore[no-untyped-def]
    r = cli("--model", "llama-3.1-70b", "--hardware", "h200", "--compare", "tp=1,2", "--markdown")
    assert r.code == 0, r.err
    header = next(line for line in r.out.splitlines() if line.startswith("|   |"))
    assert header == "|   | tp=1 | tp=2 |"
    assert "does not fit: llama-3.1-70b cannot fit on H200" in r.out
    d = json.loads(cli("--model", "llama-3.1-70b", "--hardware", "l40s", "--compare", "tp=1,8", "--json").out)
    assert d["variants"][0]["error"] is not None and "cannot fit" in d["variants"][0]["error"]
    assert d["variants"][1]["plan"]["num_blocks"] > 0


def test_list(cli) -> None:  # type: ignore[no-untyped-def]
    d = json.loads(cli("--list", "--json").out)
    assert "deepseek-v3" in d["models"] and "h200-141gb" in d["hardware"] and "multi-turn" in d["scenarios"]


def test_plot_writes_two_pngs(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    r = cli(
        "--model",
        "llama-3-8b",
        "--kv-cache-memory",
        "20GiB",
        "--max-model-len",
        "8K",
        "--plot",
        str(tmp_path),
    )
    assert r.code == 0, r.err
    for name in ("kv_per_sequence.png", "max_concurrency.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert "wrote" in r.err


def test_check_exit_code(cli) -> None:  # type: ignore[no-untyped-def]
    ok = cli(
        "--model",
        "llama-3-8b",
        "--kv-cache-memory",
        "40GiB",
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "8K",
        "--check",
        "--json",
    )
    bad = cli(
        "--model",
        "llama-3-8b",
        "--kv-cache-memory",
        "4GiB",
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "8K",
        "--check",
        "--json",
    )
    assert ok.code == 0 and bad.code == 1
    assert json.loads(bad.out)["fit"]["shortfall_bytes"] == 4 * 2**30


def test_cpu_hardware(cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from kvserve.planner import hardware

    measured = [20e9, 30e9]
    monkeypatch.setattr(hardware, "measure_bandwidth", lambda: measured.pop(0))
    monkeypatch.setattr(hardware, "measure_matmul_flops", lambda: 1e11)
    from kvserve.model import gemm_plan
    from kvserve.model.gemm_paths import BANDS

    monkeypatch.setattr(gemm_plan, "candidate_paths", lambda: ("native", "fbgemm_fp16_x1"))
    monkeypatch.setattr(gemm_plan, "measure", lambda roles, paths, dtype, timer=None: {
        r.role: [{"native": 2.0, "fbgemm_fp16_x1": 1.0}] * len(BANDS) for r in roles})
    from kvserve.model import attention_choice

    monkeypatch.setattr(attention_choice.attention_native, "native_module", lambda: object())
    monkeypatch.setattr(attention_choice.native, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(attention_choice, "measure", lambda *a, **k: {
        role: {"torch_sdpa": 1.0 if "q>" in role else 3.0, "native": 2.0} for role in attention_choice.ROLES})
    d = plan_json(cli, "--model", "smollm2-135m", "--hardware", "cpu")
    assert d["hardware"]["preset"] == "cpu" and d["hardware"]["bandwidth_bytes_s"] == 20e9
    assert {(k["role"], k["choice"]) for k in d["kernels"]} >= {("gemm_mlp", "fbgemm_fp16_x1")}
    # 4 roles x 5 bands of GEMM + 4 attention bands, all measured; + which path the kernel itself runs
    # (float pools, int8 pools)
    # (and the native build's target where a native kernel was built in this process)
    targets = [k for k in d["kernels"] if k["role"] == "native_target"]
    assert len(targets) <= 1 and all(k["choice"].startswith("native: ") for k in targets)
    assert {k["source"] for k in d["kernels"] if k["role"] not in ("attention_native", "native_target")} == {"measured"}
    assert len(d["kernels"]) - len(targets) == 4 * len(BANDS) + len(attention_choice.ROLES) + 2
    assert {(k["role"], k["band"], k["choice"]) for k in d["kernels"] if k["role"].startswith("attention_")} == {
        ("attention_decode", "all", "native"), ("attention_prefill", "q<=96", "native"),
        ("attention_prefill", "q<=512", "native"), ("attention_prefill", "q>512", "torch_sdpa"),
        ("attention_native", "all", "scalar"),
        ("attention_native", "int8_kv", "scalar")}  # a stand-in module
    assert "Kernels on this CPU" in cli("--model", "smollm2-135m", "--hardware", "cpu").out
    assert d["ledger"]["kv_budget_bytes"] > 0
    cached = plan_json(cli, "--model", "smollm2-135m", "--hardware", "cpu")
    assert cached["hardware"]["bandwidth_bytes_s"] == 20e9  # from the cache, not measured again
    again = plan_json(cli, "--model", "smollm2-135m", "--hardware", "cpu", "--remeasure")
    assert again["hardware"]["bandwidth_bytes_s"] == 30e9 and measured == []


def test_module_entry_point_runs_in_a_subprocess(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve.planner",
            "plan",
            "--model",
            "llama-3-8b",
            "--kv-cache-memory",
            "4GiB",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["num_blocks"] == 4 * 2**30 // (131072 * 16)
    bad = subprocess.run(
        [sys.executable, "-m", "kvserve.planner", "plan", "--model", "llama-3-8c"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0
    assert bad.stderr.startswith("kvserve: error: unknown model preset 'llama-3-8c'; did you mean llama-3-8b")


def test_registered_on_the_kvserve_cli() -> None:
    from typer.testing import CliRunner

    # the CLI registers these modules' commands: an import error must fail here, not skip
    import kvserve.engine.cli_generate
    import kvserve.model.make_model  # noqa: F401
    from kvserve.cli import app

    r = CliRunner().invoke(app, ["plan", "--model", "llama-3-8b", "--kv-cache-memory", "4GiB", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["token_capacity"] == 4 * 2**30 // (131072 * 16) * 16
