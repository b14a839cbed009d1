"""Loading checkpoints: config forms, sharded weights, dtypes, and the errors a user can hit."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvserve.model.cpu_gemm import PackedFp16Linear, PackedFp16MLP, fbgemm_fp16_available
from kvserve.model.gemm_plan import default_path
from kvserve.model.loader import load_model, load_tokenizer
from kvserve.model.make_model import to_hub_form
from kvserve.model.registry import get_model_class, supported_architectures

from .helpers import PagedRunner, build_hf_model, random_prompt

Checkpoint = Callable[[str], tuple[Path, torch.nn.Module]]


def prompt_logits(path: Path, dtype: str = "auto", n: int = 20) -> torch.Tensor:
    model, config = load_model(path, dtype=dtype)
    runner = PagedRunner(model, config)
    prompt = random_prompt(n, config.vocab_size, seed=4)
    return runner.prefill(prompt, runner.new_block_table(n))


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_registry_matches_supported_architectures() -> None:
    assert supported_architectures() == sorted(SUPPORTED_ARCHITECTURES)
    with pytest.raises(ValueError) as err:
        get_model_class("GPT2LMHeadModel")
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


def test_hub_form_and_transformers5_form_configs_load_the_same(hf_checkpoint: Checkpoint, tmp_path: Path) -> None:
    src, _ = hf_checkpoint("llama31-rope")
    v5 = json.loads((src / "config.json").read_text())
    assert "rope_parameters" in v5 and "dtype" in v5          # transformers 5 wrote this form
    hub_dir = copy_checkpoint(src, tmp_path / "hub")
    hub = to_hub_form(v5)
    assert "rope_parameters" not in hub and hub["rope_scaling"]["rope_type"] == "llama3"
    assert hub["torch_dtype"] == "float32" and "dtype" not in hub
    (hub_dir / "config.json").write_text(json.dumps(hub))

    assert ModelConfig.from_path(hub_dir) == ModelConfig.from_path(src)
    assert ModelConfig.from_path(src).rope_scaling.kind == "llama3"
    assert torch.equal(prompt_logits(hub_dir), prompt_logits(src))


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path, hf_checkpoint: Checkpoint) -> None:
    single, hf = hf_checkpoint("qwen2-bias-tied")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert torch.equal(prompt_logits(sharded), prompt_logits(single))


@pytest.mark.parametrize("pack", [False, True], ids=["torch-gemm", "fbgemm-fp16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load_in_their_dtype(dtype: torch.dtype, pack: bool, tmp_path: Path) -> None:
    if pack and not fbgemm_fp16_available():
        pytest.skip("no FBGEMM in this torch build")
    hf = build_hf_model("qwen2-bias-tied").to(dtype)
    hf.save_pretrained(tmp_path)
    model, config = load_model(tmp_path, cpu_fp16_gemm=pack)
    assert config.dtype == {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    packed = [m for m in model.modules() if isinstance(m, PackedFp16Linear)]
    assert len(packed) == (2 * config.num_hidden_layers + 1 if pack else 0)  # qkv, o; logits
    mlps = [m for m in model.modules() if isinstance(m, PackedFp16MLP)]
    assert len(mlps) == (config.num_hidden_layers if pack else 0)             # gate_up + down each

    prompt = random_prompt(20, config.vocab_size, seed=4)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    runner = PagedRunner(model, config)
    ours = runner.prefill(prompt, runner.new_block_table(len(prompt)))
    # Same math in the same half dtype; fused projections round a little differently: allow a few
    # units in the last place of the dtype at the logits' scale (observed: 1 ulp).
    tol = 4 * torch.finfo(dtype).eps * max(1.0, ref.abs().max().item())
    assert (ours - ref).abs().max().item() <= tol

    upcast, up_config = load_model(tmp_path, dtype="fp32")
    assert up_config.dtype == "float32"
    assert {p.dtype for p in upcast.parameters()} == {torch.float32}
    assert not any(isinstance(m, PackedFp16Linear) for m in upcast.modules())  # fp32 never packs


def test_fbgemm_packing_is_automatic_for_half_weights_on_cpu(hf_checkpoint: Checkpoint) -> None:
    """An untimed (small) half model takes the CPU's default path: FBGEMM's packed fp16 where the
    CPU has no half-precision matmul units, torch's matmul where it has (AMX, AVX-512 BF16)."""
    if not fbgemm_fp16_available():
        pytest.skip("no FBGEMM in this torch build")
    model, _ = load_model(hf_checkpoint("llama-gqa")[0], dtype="bf16")
    packed = default_path(torch.bfloat16) == "fbgemm_fp16"
    assert any(isinstance(m, PackedFp16Linear) for m in model.modules()) == packed
    with pytest.raises(ValueError, match="needs device cpu"):
        load_model(hf_checkpoint("llama-gqa")[0], dtype="bf16", device="meta", cpu_fp16_gemm=True)


def test_dtype_override_casts_fp32_checkpoint(hf_checkpoint: Checkpoint) -> None:
    path, _ = hf_checkpoint("qwen3-qknorm")
    model, config = load_model(path, dtype="bf16")
    assert config.dtype == "bfloat16"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())


def test_loader_leaves_torch_threads_alone(hf_checkpoint: Checkpoint) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # a value nobody would pick by default
    try:
        load_model(hf_checkpoint("llama-gqa")[0])
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_unsupported_architecture_lists_supported_ones(hf_checkpoint: Checkpoint, tmp_path: Path) -> None:
    path = copy_checkpoint(hf_checkpoint("llama-gqa")[0], tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM") as err:
        load_model(path)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_no_weights_is_a_clear_error(hf_checkpoint: Checkpoint, tmp_path: Path) -> None:
    shutil.copy(hf_checkpoint("llama-gqa")[0] / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(tmp_path)


def test_missing_shard_is_named(tmp_path: Path, hf_checkpoint: Checkpoint) -> None:
    hf_checkpoint("llama-gqa")[1].save_pretrained(tmp_path, max_shard_size="60KB")
    victim = min(tmp_path.glob("*.safetensors"))
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_model(tmp_path)


def _rewrite_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(hf_checkpoint: Checkpoint, tmp_path: Path) -> None:
    path = copy_checkpoint(hf_checkpoint("llama-gqa")[0], tmp_path / "ckpt")
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path)


def test_unexpected_tensor_is_named(hf_checkpoint: Checkpoint, tmp_path: Path) -> None:
    path = copy_checkpoint(hf_checkpoint("llama-gqa")[0], tmp_path / "ckpt")
    _rewrite_weights(path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected 1 tensor\(s\): model\.layers\.0\.mlp\.extra\.weight"):
        load_model(path)


def test_wrong_shape_is_named(hf_checkpoint: Checkpoint, tmp_path: Path) -> None:
    path = copy_checkpoint(hf_checkpoint("llama-gqa")[0], tmp_path / "ckpt")
    _rewrite_weights(path, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(65,\), expected \(64,\)"):
        load_model(path)


def test_ignores_stored_rotary_buffers_and_tied_lm_head(hf_checkpoint: Checkpoint, tmp_path: Path) -> None:
    """Old checkpoints store ``rotary_emb.inv_freq``; some tied ones store lm_head too."""
    src, _ = hf_checkpoint("qwen2-bias-tied")
    path = copy_checkpoint(src, tmp_path / "ckpt")

    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    _rewrite_weights(path, add)
    assert torch.equal(prompt_logits(path), prompt_logits(src))


@pytest.mark.parametrize(("max_window_layers", "expected"), [(0, 8), (2, None)])
def test_qwen_sliding_window_follows_transformers_layer_types(
        max_window_layers: int, expected: int | None, tmp_path: Path) -> None:
    """Qwen's window applies to layers >= max_window_layers only when use_sliding_window is set."""
    hf = build_hf_model("qwen2-bias-tied", use_sliding_window=True, sliding_window=8,
                        max_window_layers=max_window_layers)
    hf.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    assert config.sliding_window == expected
    prompt = random_prompt(24, config.vocab_size, seed=4)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    runner = PagedRunner(model, config)
    assert (runner.prefill(prompt, runner.new_block_table(len(prompt))) - ref).abs().max().item() <= 1e-4


def test_qwen_mixed_window_layers_are_refused() -> None:
    cfg = build_hf_model("qwen2-bias-tied", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(ValueError, match="mixes sliding-window and full-attention layers"):
        ModelConfig.from_hf_dict({**cfg.config.to_dict(), "architectures": ["Qwen2ForCausalLM"]})
