"""Bad input: a clear ValueError naming the limit, and nothing queued or leaked."""

from __future__ import annotations

import json

import pytest

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", kv_cache_memory="8MiB", max_model_len=64)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}])


def test_prompt_over_max_model_len_names_both_numbers(llm):
    with pytest.raises(ValueError, match=r"60 tokens.*max_tokens \(10\).*max_model_len \(64\)"):
        llm.generate([{"prompt_token_ids": list(range(60))}], SamplingParams(max_tokens=10))
    assert not llm.engine.has_unfinished_requests()


def test_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": list(range(100))}])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.usage().used == 0


def test_token_ids_out_of_vocab(llm):
    with pytest.raises(ValueError, match="token ids must be integers in"):
        llm.generate([{"prompt_token_ids": [1, 10**9]}])


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"n": 0}, "n must be"),
    ({"stop": [""]}, "stop strings"),
    ({"logprobs": 50}, "logprobs"),
])
def test_nonsense_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tmp_path / "nope")


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8}))
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, Qwen2ForCausalLM"):
        LLM(tmp_path)


def test_kv_budget_smaller_than_one_block(tiny_llama):
    with pytest.raises(ValueError, match="smaller than one block"):
        LLM(tiny_llama, dtype="float32", kv_cache_memory=100)
