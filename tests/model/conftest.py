"""Session fixtures for the model-runtime tests (see helpers.py for what they build)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from .helpers import PagedRunner, build_hf_model, random_prompt


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and on a shared 2-core machine OpenMP workers that
    spin while other processes hold the cores make small ops 100x slower. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    """``case -> (folder, the transformers model)``; each case built and saved once per session."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(case: str) -> tuple[Path, torch.nn.Module]:
        if case not in cache:
            model = build_hf_model(case)
            out = tmp_path_factory.mktemp(case)
            model.save_pretrained(out)
            cache[case] = (out, model)
        return cache[case]

    return get


@pytest.fixture
def paged_runner() -> type[PagedRunner]:
    return PagedRunner


@pytest.fixture
def make_prompt() -> Callable[..., list[int]]:
    return random_prompt
