"""The engine on a CUDA device: the model and its KV live there, and greedy tokens equal the CPU
engine's on a tiny random-weight Llama (fp32). Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.engine.conftest import write_tiny_llama

pytestmark = pytest.mark.cuda

PROMPTS = [[5, 17, 300, 42], list(range(100, 137)), [7]]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-cuda"))


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def test_the_model_runs_on_cuda_and_matches_cpu_greedy_tokens(tiny: Path) -> None:
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both sides
    try:
        gpu = LLM(tiny, dtype="float32", device="cuda", kv_cache_memory="8MiB", block_size=16)
        assert gpu.engine.device.type == "cuda"
        assert {p.device.type for p in gpu.engine.model.parameters()} == {"cuda"}
        gpu_tokens = greedy(gpu)
        gpu.engine.kv.check()
        assert gpu.engine.kv.usage().used == 0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    cpu = LLM(tiny, dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=16)
    assert gpu_tokens == greedy(cpu)
    assert all(len(t) == GREEDY.max_tokens for t in gpu_tokens)
