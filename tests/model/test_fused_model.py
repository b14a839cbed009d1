"""The model with the fused native ops and with their torch fallback (KVSERVE_NATIVE=0) agrees
with transformers, and the two agree with each other (fp32: same logits to float rounding; bf16:
the same greedy tokens)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvserve import native
from kvserve.model.loader import load_model
from kvserve.native import fused

from .helpers import PagedRunner, random_prompt

Checkpoint = Callable[[str], tuple[Path, torch.nn.Module]]


@pytest.fixture
def fallback(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fused ops switched off, as with KVSERVE_NATIVE=0 at start-up."""
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setattr(native, "_why", {})
    monkeypatch.setenv("KVSERVE_NATIVE", "0")
    fused._ext.cache_clear()
    yield
    fused._ext.cache_clear()


def logits(path: Path, dtype: str = "auto") -> torch.Tensor:
    model, config = load_model(path, dtype=dtype)
    runner = PagedRunner(model, config)
    prompt = random_prompt(24, config.vocab_size, seed=5)
    return runner.prefill(prompt, runner.new_block_table(24))


@pytest.mark.parametrize("case", ["llama-gqa", "qwen3-qknorm", "qwen2-bias-tied"])
def test_native_and_fallback_agree_with_transformers(case: str, hf_checkpoint: Checkpoint,
                                                     request: pytest.FixtureRequest) -> None:
    path, hf = hf_checkpoint(case)
    with torch.no_grad():
        ref = hf(torch.tensor([random_prompt(24, hf.config.vocab_size, seed=5)])).logits[0]
    ours = logits(path)
    request.getfixturevalue("fallback")
    assert fused._ext() is None
    torch_ops = logits(path)
    assert (ours - ref).abs().max().item() <= 1e-4
    assert (torch_ops - ref).abs().max().item() <= 1e-4
    assert (ours - torch_ops).abs().max().item() <= 1e-5


def test_bf16_greedy_tokens_are_the_same_with_and_without_native_ops(hf_checkpoint: Checkpoint,
                                                                     request: pytest.FixtureRequest) -> None:
    path, _ = hf_checkpoint("llama-gqa")

    def greedy() -> list[int]:
        model, config = load_model(path, dtype="bf16")
        return PagedRunner(model, config).greedy(random_prompt(12, config.vocab_size, seed=2), 24)[0]

    native_tokens = greedy()
    request.getfixturevalue("fallback")
    assert native_tokens == greedy()
