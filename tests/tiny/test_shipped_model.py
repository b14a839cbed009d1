"""The shipped tiny chat model: loads with transformers, has learned the stdlib, talks Python.

Thresholds come from the measurement in docs/model.md (held-out perplexity of the full set and of
the subset used here); a random-weight model of the same shape scores about the vocabulary size.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.assets import default_model_path
from kvserve.config import ModelConfig
from kvserve.tiny import eval as ev

SUBSET_TEXTS = 8
SUBSET_CHARS = 1500
PPL_THRESHOLD = 200.0
"""Measured on this subset: 142 (random weights: 4250; full held-out set: 91, see docs/model.md).
The bar leaves room for small stdlib differences between machines."""

PROMPTS = (
    "Write the function `def is_palindrome(s)` for `strutil`:\n\nReturn True if s reads the same backwards.",
    "Write the function `def read_lines(path)` for `fileutil`:\n\nReturn the lines of the file at path.",
    "Write the class `class Stack` for `collections`:\n\nA last-in, first-out stack backed by a list.",
)


@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(2)
    return ev.load(default_model_path())


@pytest.fixture(scope="module")
def subset() -> list[str]:
    return ev.heldout_subset(SUBSET_TEXTS, SUBSET_CHARS)


def test_config_is_llama_with_gqa() -> None:
    import json

    cfg = ModelConfig.from_hf_dict(json.loads((default_model_path() / "config.json").read_text()))
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.max_position_embeddings == 2048
    assert set(cfg.eos_token_ids) == {0, 2}


def test_heldout_perplexity_is_low_and_far_below_random(loaded, subset) -> None:
    from transformers import LlamaForCausalLM

    model, tok = loaded
    trained = ev.perplexity(model, tok, subset)
    assert trained.tokens > 1000
    torch.manual_seed(0)
    random_model = LlamaForCausalLM(model.config).eval()
    random = ev.perplexity(random_model, tok, subset)
    assert random.ppl > 0.25 * model.config.vocab_size
    assert trained.ppl < PPL_THRESHOLD
    assert trained.ppl < random.ppl / 20


def _looks_like_python(reply: str) -> bool:
    has_keyword = any(k in reply for k in ("def ", "return", "self", "class ", "import ", "if "))
    has_block = ":\n" in reply and "\n    " in reply
    return has_keyword and has_block


def test_greedy_completions_look_like_python(loaded) -> None:
    model, tok = loaded
    replies = [ev.greedy_reply(model, tok, p, max_new_tokens=48) for p in PROMPTS]
    assert all(_looks_like_python(r) for r in replies), replies
    assert any("def " in r for r in replies), replies


def test_random_model_does_not_look_like_python(loaded) -> None:
    """The behavioural check above can fail: a random model of the same shape fails it."""
    from transformers import LlamaForCausalLM

    model, tok = loaded
    torch.manual_seed(0)
    random_model = LlamaForCausalLM(model.config).eval()
    assert not _looks_like_python(ev.greedy_reply(random_model, tok, PROMPTS[0], max_new_tokens=48))


def test_kvserve_greedy_tokens_match_transformers(loaded) -> None:
    import kvserve.engine.llm as llm_mod
    from kvserve.sampling_params import SamplingParams

    model, tok = loaded
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       tokenize=False) for p in PROMPTS[:2]]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    llm = llm_mod.LLM(model=default_model_path(), dtype="float32", kv_cache_memory="16MiB")
    # Both stop at the model's EOS ids (generation_config.json); both include the EOS token.
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=32, temperature=0))
    for prompt_ids, out in zip(ids, outs, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt_ids):].tolist()
