"""The CUDA set (every module ``cuda``-marked: skipped without a GPU, tests/conftest.py) reuses the
CPU suite's random-weight models and transformers references. fp32 means fp32 on the GPU too:
TF32 matmuls are off for every test here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.engine.conftest import hf_mistral, hf_tiny_llama, tiny_llama, tiny_mistral  # noqa: F401


@pytest.fixture(autouse=True)
def no_tf32() -> Iterator[None]:
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = prev
