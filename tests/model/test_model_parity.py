"""Parity of kvserve's runtime with transformers on random-weight fp32 checkpoints.

Tolerance: max |logit difference| <= 1e-4 in fp32 (observed ~3e-7), and the 64 greedy tokens
of our paged decode loop equal ``transformers.generate(do_sample=False)`` exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve.model.loader import load_model

from .helpers import PARITY_CASES, PagedRunner, random_prompt

LOGIT_TOL = 1e-4
NEW_TOKENS = 64
Checkpoint = Callable[[str], tuple[Path, torch.nn.Module]]


def prompt_len(case: str) -> int:
    # Mistral's window is 16: its prompt (40) alone already spans more than two windows.
    return 40 if "mistral" in case else 24


@pytest.fixture(scope="module")
def loaded(hf_checkpoint: Checkpoint) -> Callable[[str], tuple]:
    cache: dict[str, tuple] = {}

    def get(case: str) -> tuple:
        if case not in cache:
            path, hf = hf_checkpoint(case)
            model, config = load_model(path)
            cache[case] = (model, config, hf)
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_prompt_logits_match_transformers(case: str, loaded: Callable[[str], tuple]) -> None:
    model, config, hf = loaded(case)
    n = prompt_len(case)
    prompt = random_prompt(n, config.vocab_size, seed=1)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]                    # [P, vocab]

    whole = PagedRunner(model, config).prefill(prompt, PagedRunner(model, config).new_block_table(n))
    runner = PagedRunner(model, config, seed=3)
    chunked = runner.prefill(prompt, runner.new_block_table(n), chunk_sizes=[9, 7, n - 16])

    assert whole.shape == ref.shape
    assert (whole - ref).abs().max().item() <= LOGIT_TOL
    assert (chunked - ref).abs().max().item() <= LOGIT_TOL


@pytest.fixture(scope="module")
def hf_greedy(loaded: Callable[[str], tuple]) -> Callable[[str], tuple[list[int], list[int]]]:
    """``case -> (prompt, transformers' 64 greedy tokens)``, computed once per case."""
    cache: dict[str, tuple[list[int], list[int]]] = {}

    def get(case: str) -> tuple[list[int], list[int]]:
        if case not in cache:
            _, config, hf = loaded(case)
            prompt = random_prompt(prompt_len(case), config.vocab_size, seed=2)
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
            cache[case] = (prompt, out[0, len(prompt):].tolist())
        return cache[case]

    return get


def backend_for(name: str | None) -> object:
    """None: attention.paged_attention directly; "native": the C++ kernel (skipped without it)."""
    if name is None:
        return None
    from kvserve.model.attention_native import NativePagedBackend, native_module, unavailable_reason

    if native_module() is None:
        pytest.skip(f"no native kernel: {unavailable_reason()}")
    return NativePagedBackend()


@pytest.mark.parametrize("backend", [None, "native"])
@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_greedy_tokens_match_transformers_generate(case: str, backend: str | None, loaded: Callable[[str], tuple],
                                                   hf_greedy: Callable[[str], tuple]) -> None:
    model, config, _ = loaded(case)
    prompt, expected = hf_greedy(case)
    assert len(expected) == NEW_TOKENS
    tokens, _ = PagedRunner(model, config, seed=5, backend=backend_for(backend)).greedy(prompt, NEW_TOKENS)
    assert tokens == expected


@pytest.mark.parametrize("backend", [None, "native"])
@pytest.mark.parametrize("case", ["llama-gqa", "mistral-window"])
def test_chunked_prefill_then_decode_matches_generate(case: str, backend: str | None, loaded: Callable[[str], tuple],
                                                      hf_greedy: Callable[[str], tuple]) -> None:
    model, config, _ = loaded(case)
    prompt, expected = hf_greedy(case)
    runner = PagedRunner(model, config, seed=6, backend=backend_for(backend))
    tokens, _ = runner.greedy(prompt, NEW_TOKENS, chunk_sizes=[5, 11, len(prompt) - 16])
    assert tokens == expected


@pytest.mark.parametrize("case", ["llama-gqa", "mistral-window", "qwen3-qknorm"])
def test_mixed_batch_matches_each_sequence_alone(case: str, loaded: Callable[[str], tuple]) -> None:
    """One step packing a prefill chunk, a first chunk and two decodes gives each sequence the
    logits it gets alone."""
    model, config, _ = loaded(case)
    runner = PagedRunner(model, config, seed=7)
    prompts = [random_prompt(n, config.vocab_size, seed=10 + n) for n in (30, 12, 21, 3)]
    tables = [runner.new_block_table(len(p)) for p in prompts]
    # Seqs 0 and 2 have all but their last token cached; seq 1 has its first 5 cached; seq 3 none.
    runner.prefill(prompts[0][:-1], tables[0])
    runner.prefill(prompts[1][:5], tables[1])
    runner.prefill(prompts[2][:-1], tables[2])
    batch = runner.step([
        (prompts[0][-1:], len(prompts[0]) - 1, tables[0]),
        (prompts[1][5:], 5, tables[1]),
        (prompts[2][-1:], len(prompts[2]) - 1, tables[2]),
        (prompts[3], 0, tables[3]),
    ])
    starts = [0, 1, 1 + len(prompts[1]) - 5, 2 + len(prompts[1]) - 5]
    for i, prompt in enumerate(prompts):
        alone = PagedRunner(model, config, seed=20 + i)
        ref = alone.prefill(prompt, alone.new_block_table(len(prompt)))
        q = 1 if i in (0, 2) else (len(prompt) - 5 if i == 1 else len(prompt))
        got = batch[starts[i]:starts[i] + q]
        assert (got - ref[-q:]).abs().max().item() <= 1e-5, f"sequence {i}"


def test_mistral_window_matters(loaded: Callable[[str], tuple]) -> None:
    """Without the window our logits would differ from transformers beyond the tolerance, so the
    Mistral parity test really checks the window (and the model applies it without help from meta)."""
    model, config, hf = loaded("mistral-window")
    prompt = random_prompt(40, config.vocab_size, seed=1)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    model.config = dataclasses.replace(config, sliding_window=None)
    try:
        runner = PagedRunner(model, config)
        full = runner.prefill(prompt, runner.new_block_table(len(prompt)))
    finally:
        model.config = config
    assert (full - ref).abs().max().item() > 100 * LOGIT_TOL
