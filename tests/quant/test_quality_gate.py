"""The quality gate: lossy KV on the shipped trained model, measured through the engine.

Two held-out conversations (never trained on), 192 tokens each, are scored teacher-forced with
full-precision KV and with each codec (``kvserve.eval.kv_quality``, fed a block of 16 tokens per
step so the gate stays fast; ``kvserve eval kv`` defaults to one token per step). Budgets:

* int8 and fp8: mean KL(full ‖ codec) ≤ 1e-3 nats per token (the issue's gate);
* int4 (KIVI: keys per channel over 16 tokens, values per token): mean KL ≤ INT4_KL_BUDGET and
  |ΔPPL| ≤ INT4_PPL_BUDGET_PCT, set from the measurement on the final weights (below and in
  docs/kv-quant.md) with headroom for machine-to-machine float differences.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.assets import default_model_path
from kvserve.eval.kv_quality import EvalConfig, run_eval
from kvserve.tiny import data

INT8_FP8_KL_BUDGET = 1e-3
# Measured on the final weights with exactly this test's setup: int8 2.7e-5, fp8 2.4e-4, int4 7.4e-4
# with the default 4 sink tokens (1.1e-3 without; ΔPPL +0.05 %, +0.5 % without). The int4 budgets
# leave ~4-7x headroom: a broken codec (e.g. per-token int4 keys, or a wrong scale) lands far above.
INT4_KL_BUDGET = 5e-3
INT4_PPL_BUDGET_PCT = 2.0


def heldout_sequences(tokenizer: object, count: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of the first ``count`` held-out source files' conversations."""
    root = data.stdlib_root()
    out: list[list[int]] = []
    for rel in data.source_files(root):
        if not data.is_heldout(rel):
            continue
        convs = data.file_conversations(root, rel)
        if convs:
            ids = tokenizer.encode(data.render_chatml(convs[0]), add_special_tokens=False)  # type: ignore[attr-defined]
            if len(ids) >= length:
                out.append(list(ids[:length]))
        if len(out) == count:
            return out
    raise AssertionError("not enough held-out text")


@pytest.fixture(scope="module")
def report():  # type: ignore[no-untyped-def]
    from kvserve.model.loader import load_tokenizer

    before = torch.get_num_threads()
    model = str(default_model_path())
    seqs = heldout_sequences(load_tokenizer(model), 2, 192)
    cfg = EvalConfig(model=model, codecs=("fp8", "int8", "int4"), texts=2, max_tokens=192, chunk=16,
                     greedy_prompts=0, greedy_tokens=0, kv_cache_memory=16 * 2**20, num_threads=1)
    try:
        yield run_eval(cfg, sequences=seqs)
    finally:
        torch.set_num_threads(before)


def test_int8_and_fp8_kl_within_the_gate(report) -> None:  # type: ignore[no-untyped-def]
    for codec in ("int8", "fp8"):
        r = report.codecs[codec]
        assert r.kl <= INT8_FP8_KL_BUDGET, f"{codec}: mean KL {r.kl:.2e} > {INT8_FP8_KL_BUDGET}"
        assert r.top1_agreement >= 0.95


def test_int4_within_its_budget(report) -> None:  # type: ignore[no-untyped-def]
    r = report.codecs["int4"]
    assert r.kl <= INT4_KL_BUDGET, f"int4: mean KL {r.kl:.2e} > {INT4_KL_BUDGET}"
    assert abs(r.delta_ppl_pct) <= INT4_PPL_BUDGET_PCT


def test_the_measurement_sees_the_loss(report) -> None:  # type: ignore[no-untyped-def]
    """Not vacuous: quantization changes the distributions, int4 more than int8, and the
    reference agrees with itself."""
    ref = report.codecs[report.reference]
    assert ref.kl == 0 and ref.top1_agreement == 1.0 and math.isfinite(ref.ppl)
    assert 0 < report.codecs["int8"].kl < report.codecs["int4"].kl
    assert report.codecs["int4"].bytes_per_token < report.codecs["int8"].bytes_per_token < ref.bytes_per_token
