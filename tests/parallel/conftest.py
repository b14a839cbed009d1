"""Shared models and helpers of the tensor-parallel tests: tiny random-weight checkpoints on disk."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from tests.engine.conftest import TOKENIZER_DIR
from tests.model.helpers import build_hf_model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 3 + i + 18 + 7 * i))} for i in range(3)]  # 5-10 blocks
KW = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 16, "num_threads": 1}
# (parity case, overrides): MHA; GQA with q/k/v and o biases (o's bias must be added once);
# Qwen2 GQA with q/k/v bias and tied embeddings (the embedding replicated, logits on rank 0)
CASES = {"llama-mha": ("llama-mha", {}), "llama-gqa-bias": ("llama-mqa-bias", {"num_key_value_heads": 2}),
         "qwen2-tied": ("qwen2-bias-tied", {})}


def save(case: str, out: Path, **overrides: object) -> Path:
    build_hf_model(case, **overrides).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, out / name)
    return out


def tokens(llm: LLM, prompts: list[dict[str, list[int]]] = PROMPTS, params: SamplingParams = GREEDY,
           **kw: object) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, **kw)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: save(case, tmp_path_factory.mktemp(name), **over) for name, (case, over) in CASES.items()}
