"""``kvserve make-model``: presets, checkpoints both kvserve and transformers load, the tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import typer
from safetensors import safe_open
from typer.testing import CliRunner

from kvserve.config import ModelConfig
from kvserve.kv.layout import model_kv_bytes_per_token
from kvserve.model import cli_make_model
from kvserve.model.loader import load_model, load_tokenizer
from kvserve.model.make_model import make_model, param_count
from kvserve.model.presets import PRESETS, get_preset
from kvserve.model.tokenizer_builder import CHATML_TEMPLATE, SPECIAL_TOKENS

from .helpers import PagedRunner, random_prompt

TINY = [name for name in PRESETS if name.startswith("tiny-")]

# Independent copy of the reference numbers (shared/reference/models.json): published parameter
# counts and bf16 KV bytes per token.
REFERENCE = {
    "qwen2.5-0.5b": {"params": 494032768, "kv_bytes_bf16": 12288, "layers": 24, "kv_heads": 2, "head_dim": 64,
                         "hidden": 896, "vocab": 151936, "tied": True, "arch": "Qwen2ForCausalLM"},
    "llama-3.2-1b": {"params": 1235814400, "kv_bytes_bf16": 32768, "layers": 16, "kv_heads": 8, "head_dim": 64,
                         "hidden": 2048, "vocab": 128256, "tied": True, "arch": "LlamaForCausalLM"},
    "smollm2-135m": {"params": 134515008, "kv_bytes_bf16": 23040, "layers": 30, "kv_heads": 3, "head_dim": 64,
                         "hidden": 576, "vocab": 49152, "tied": True, "arch": "LlamaForCausalLM"},
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = make_model(name, tmp_path_factory.mktemp(name), seed=0)
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_big_presets_match_reference_shapes(name: str) -> None:
    ref = REFERENCE[name]
    preset = get_preset(name)
    config = ModelConfig.from_hf_dict(preset.hf_config())
    assert param_count(preset) == ref["params"] == preset.reference_params
    assert model_kv_bytes_per_token(config, "bfloat16") == ref["kv_bytes_bf16"]
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (
        ref["layers"], ref["kv_heads"], ref["head_dim"])
    assert (config.hidden_size, config.vocab_size, config.tie_word_embeddings, config.architecture) == (
        ref["hidden"], ref["vocab"], ref["tied"], ref["arch"])
    assert config.dtype == "bfloat16"


def test_tiny_presets_cover_every_feature() -> None:
    configs = {n: ModelConfig.from_hf_dict(PRESETS[n].hf_config()) for n in TINY}
    assert {c.architecture for c in configs.values()} == {
        "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}
    kinds = {(c.num_attention_heads, c.num_key_value_heads) for c in configs.values()}
    assert {(4, 4), (4, 2), (4, 1)} <= kinds                     # MHA, GQA, MQA
    assert configs["tiny-llama31"].rope_scaling.kind == "llama3"
    assert configs["tiny-qwen2"].tie_word_embeddings and configs["tiny-qwen2"].attention_bias
    q3 = configs["tiny-qwen3"]
    assert q3.qk_norm and q3.head_dim != q3.hidden_size // q3.num_attention_heads
    assert configs["tiny-mistral"].sliding_window == 16


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_loads_in_kvserve_and_transformers_alike(name: str, tiny_checkpoint: Callable[[str], Path]) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(name)
    model, config = load_model(path)
    hf, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tok = load_tokenizer(path)
    assert config.vocab_size >= len(tok)
    assert set(config.eos_token_ids) == {tok.convert_tokens_to_ids("<|im_end|>"),
                                         tok.convert_tokens_to_ids("<|endoftext|>")}

    prompt = random_prompt(24, config.vocab_size, seed=3)
    with torch.no_grad():
        ref = hf.eval()(torch.tensor([prompt])).logits[0]
    runner = PagedRunner(model, config)
    ours = runner.prefill(prompt, runner.new_block_table(len(prompt)))
    assert (ours - ref).abs().max().item() <= 1e-4


def test_tokenizer_round_trips_and_has_chat_template(tiny_checkpoint: Callable[[str], Path]) -> None:
    tok = load_tokenizer(tiny_checkpoint("tiny-llama"))
    for text in ["Hello, world!", "def f(x):\n    return x ** 2  # squares\n", "ünïcødé 你好 🙂", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(chat)
    assert ids[0] == 1 and 2 in ids                              # specials encode as single tokens
    assert tok.chat_template == CHATML_TEMPLATE


def test_ids_beyond_tokenizer_vocab_decode_without_error(tiny_checkpoint: Callable[[str], Path]) -> None:
    """Big presets have a model vocab far above the tokenizer's: such ids decode to nothing."""
    tok = load_tokenizer(tiny_checkpoint("tiny-llama"))
    hello = tok.encode("hello")
    assert tok.decode(hello + [151935, len(tok), 50000]) == "hello"
    assert tok.decode([len(tok) + 5]) == ""


def test_weights_depend_only_on_seed(tmp_path: Path, tiny_checkpoint: Callable[[str], Path]) -> None:
    a = tiny_checkpoint("tiny-qwen3")
    b = make_model("tiny-qwen3", tmp_path / "b", seed=0)
    c = make_model("tiny-qwen3", tmp_path / "c", seed=1)

    def tensors(p: Path) -> dict[str, torch.Tensor]:
        with safe_open(str(p / "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118

    ta, tb, tc = tensors(a), tensors(b), tensors(c)
    assert ta.keys() == tb.keys() == tc.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ta[w], tc[w])
    assert abs(ta[w].std().item() - 0.02) < 0.005                # HF-style N(0, 0.02) init
    assert torch.equal(ta["model.norm.weight"], torch.ones(64))
    assert (tmp_path / "b" / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("dtype,expected", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtype_option(dtype: str, expected: torch.dtype, tmp_path: Path) -> None:
    path = make_model("tiny-qwen2", tmp_path, dtype=dtype)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {expected}  # noqa: SIM118
    assert "lm_head.weight" not in json.dumps(list(safe_open(str(path / "model.safetensors"), "pt").keys()))
    model, _config = load_model(path)
    assert {p.dtype for p in model.parameters()} == {expected}


def test_hub_config_form_loads_like_transformers5_form(tmp_path: Path, tiny_checkpoint: Callable[[str], Path]) -> None:
    hub = make_model("tiny-llama31", tmp_path, config_form="hub")
    cfg = json.loads((hub / "config.json").read_text())
    assert "rope_parameters" not in cfg and cfg["rope_scaling"]["rope_type"] == "llama3"
    assert "torch_dtype" in cfg and "dtype" not in cfg
    assert ModelConfig.from_path(hub) == ModelConfig.from_path(tiny_checkpoint("tiny-llama31"))


def test_refuses_to_overwrite_without_force(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_checkpoint("tiny-llama")
    with pytest.raises(ValueError, match="--force"):
        make_model("tiny-llama", path)


def test_tokenizer_too_big_for_preset_vocab_is_refused(tmp_path: Path, tiny_checkpoint: Callable[[str], Path]) -> None:
    src = tiny_checkpoint("tiny-llama")
    small = get_preset("tiny-llama")
    import dataclasses

    with pytest.raises(ValueError, match="vocab_size 300 < tokenizer vocabulary 1024"):
        make_model(dataclasses.replace(small, name="small", vocab_size=300), tmp_path, tokenizer_dir=src)


def test_cli_make_model(tmp_path: Path) -> None:
    app = typer.Typer()
    cli_make_model.register(app)
    app.command("noop")(lambda: None)  # a second command keeps typer in sub-command mode
    result = CliRunner().invoke(app, ["make-model", "--preset", "tiny-mistral", "--out", str(tmp_path / "m"),
                                      "--seed", "3", "--dtype", "bf16"])
    assert result.exit_code == 0, result.output
    assert "tiny-mistral" in result.output and "205,120 parameters" in result.output
    assert ModelConfig.from_path(tmp_path / "m").sliding_window == 16
    bad = CliRunner().invoke(app, ["make-model", "--preset", "nope", "--out", str(tmp_path / "x")])
    assert bad.exit_code != 0 and "unknown preset 'nope'" in str(bad.exception)
