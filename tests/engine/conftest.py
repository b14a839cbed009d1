"""A tiny random-weight Llama (GQA) checkpoint made with transformers, plus the shipped tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "kvserve" / "assets" / "models" / "kvserve-tiny-chat"


def write_tiny_llama(out: Path, seed: int = 0, arch: str = "Llama", **overrides) -> Path:
    """``arch``: the transformers family (``Llama``, ``Mistral`` with ``sliding_window``, ...)."""
    import transformers

    config_cls, model_cls = getattr(transformers, f"{arch}Config"), getattr(transformers, f"{arch}ForCausalLM")
    kwargs = {"vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "initializer_range": 0.1, "eos_token_id": 2, "bos_token_id": None, "tie_word_embeddings": False}
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).to(torch.float32).eval()
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_llama):
    return load_hf(tiny_llama)


MISTRAL_WINDOW = 16


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory) -> Path:
    """The tiny model as Mistral: every layer under a 16-token sliding window."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-mistral"), arch="Mistral", vocab_size=512,
                            sliding_window=MISTRAL_WINDOW)


@pytest.fixture(scope="session")
def hf_mistral(tiny_mistral):
    return load_hf(tiny_mistral)


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
