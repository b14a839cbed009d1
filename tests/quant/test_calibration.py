"""Precision per layer against a KL budget: the budget's syntax, the greedy choice, calibration on
the shipped chat model (the joint KL it measures stays within the budget; a looser budget never
picks more bytes), the calibration file and the engine started from it.

Calibration here scores 2 held-out texts × 64 tokens, 16 per step (the engine default is 4 × 256).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.config import CacheConfig, EngineConfig
from kvserve.engine.llm import LLM, resolve_model_path
from kvserve.eval.calibrate import (
    CalibrationText,
    Calibrator,
    calibrate,
    calibration_config,
    heldout_sequences,
    resolve_calibration,
)
from kvserve.kv.calibration import (
    DEFAULT_BUDGET_KL,
    Calibration,
    apply_moves,
    greedy_moves,
    parse_quality_budget,
)
from kvserve.kv.codec_names import KVCodecSpec
from kvserve.kv.layout import side_block_bytes
from kvserve.model.loader import load_model_config, load_tokenizer
from kvserve.sampling_params import SamplingParams

TEXT = CalibrationText(texts=2, max_tokens=64, chunk=16)
BUDGETS = (1e-5, 3e-4, 1e-2)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/quant/conftest.py


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def chat() -> str:
    return resolve_model_path(None)


def test_budget_syntax() -> None:
    assert parse_quality_budget("kl=1e-3") == 1e-3
    assert parse_quality_budget(" KL = 2e-4 ") == 2e-4
    assert parse_quality_budget("default") == DEFAULT_BUDGET_KL == parse_quality_budget(None)
    for bad, why in (("kl=abc", "cannot read"), ("ppl=1%", "only 'kl'"), ("kl=-1", "> 0"), ("kl=nan", "> 0"),
                     ("kl=inf", "> 0")):
        with pytest.raises(ValueError, match=why):
            parse_quality_budget(bad)
    with pytest.raises(ValueError, match="kl=1e-3"):
        CacheConfig(kv_quality_budget="1e-3x")
    with pytest.raises(ValueError, match="need kv_cache_dtype='auto'"):
        CacheConfig(kv_cache_dtype="int8", kv_quality_budget="kl=1e-3")
    assert CacheConfig(kv_quality_budget="kl=1e-3").calibrated and not CacheConfig().calibrated


def test_bad_budget_on_the_cli_is_one_line_and_exit_2() -> None:
    out = subprocess.run([sys.executable, "-c", "from kvserve.cli import main; main()", "serve",
                          "--kv-quality-budget", "kl=lots"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "kv_quality_budget" in out.stderr


def side_bytes(codec: str, side: str) -> int:
    return side_block_bytes(codec, side, 16, 2, 32)


def test_greedy_keeps_the_summed_kl_within_budget_and_prefers_cheap_kl() -> None:
    singles = {}
    for layer in range(3):
        for side in ("k", "v"):
            base = 1e-4 * (10 if layer == 0 else 1)  # layer 0 is sensitive
            singles.update({(layer, side, "fp8"): 3 * base, (layer, side, "int8"): base,
                            (layer, side, "int4"): 4 * base})
    sizes = []
    for budget in (1e-4, 1e-3, 3e-3, 1.0):
        moves = greedy_moves(3, "bfloat16", singles, side_bytes, budget)
        assert sum(m.added for m in moves) <= budget
        pairs = apply_moves(3, "bfloat16", moves)
        sizes.append(sum(side_bytes(p.k, "k") + side_bytes(p.v, "v") for p in pairs))
        assert all("fp8" not in (p.k, p.v) for p in pairs)  # int8: same bytes, less KL
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    assert apply_moves(3, "bfloat16", greedy_moves(3, "bfloat16", singles, side_bytes, 1.0)) == \
        (KVCodecSpec("int4", "int4"),) * 3
    loose = apply_moves(3, "bfloat16", greedy_moves(3, "bfloat16", singles, side_bytes, 1e-3))
    assert loose[0] == KVCodecSpec("bfloat16", "bfloat16")  # the sensitive layer is the one left whole


def test_calibration_on_the_chat_model_respects_the_budget_and_is_monotone(chat: str) -> None:
    model = load_model_config(chat)
    cache = CacheConfig()
    full = model.num_hidden_layers * 2 * side_block_bytes("bfloat16", "k", 16, 2, 32)
    cal = Calibrator(calibration_config(EngineConfig(model=chat), TEXT, full // 16),
                     heldout_sequences(load_tokenizer(chat), TEXT), TEXT.chunk)
    results = [calibrate(cal, b, model, cache) for b in BUDGETS]
    for budget, r in zip(BUDGETS, results):
        assert r.joint_kl <= budget
        assert r.joint_kl == cal.kl(r.pairs)  # the joint figure is the whole map's, measured
        assert r.full_bytes_per_token == full // 16
    sizes = [r.bytes_per_token for r in results]
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[-1] < sizes[0] and sizes[-1] < results[-1].full_bytes_per_token
    assert results[0].kv_dtype != results[-1].kv_dtype
    assert cal.measured <= 1 + model.num_hidden_layers * 2 * 3 + 3 * 8  # singles once, a few joint checks


def test_calibration_file_is_written_read_and_drives_the_engine(chat: str, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    file = tmp_path / "cal.json"
    model = load_model_config(chat)
    cfg = EngineConfig(model=chat, cache=CacheConfig(kv_quality_budget="kl=3e-4", kv_calibration=str(file)))
    first = resolve_calibration(cfg, model, load_tokenizer(chat), TEXT)
    assert file.exists() and "saved to" in first.source and first.joint_kl <= 3e-4
    again = resolve_calibration(cfg, model, load_tokenizer(chat), TEXT)
    assert again.source == str(file) and again.kv_dtype == first.kv_dtype
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(chat, kv_cache_dtype="auto", kv_calibration=file, kv_cache_memory="8MiB", num_threads=1)
    assert llm.engine.kv_dtype == first.kv_dtype
    assert llm.engine.capacity.bytes_per_token == first.bytes_per_token
    assert "layer 0: K" in caplog.text and "tokens vs" in caplog.text
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8))
    assert out[0].outputs[0].token_ids
    doc = json.loads(file.read_text())
    doc["layers"] = doc["layers"][:-1]
    bad = tmp_path / "short.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="does not match its layers|has 5 layers"):
        LLM(chat, kv_cache_dtype="auto", kv_calibration=bad, kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match="calibrated for kl=0.0003"):
        LLM(chat, kv_cache_dtype="auto", kv_calibration=file, kv_quality_budget="kl=1e-2", kv_cache_memory="8MiB")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read KV calibration file"):
        Calibration.load(tmp_path / "junk.json")
