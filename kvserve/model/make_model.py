"""``kvserve make-model``: write a random-weight Hugging Face checkpoint for tests and benchmarks.

Output folder::

    config.json             transformers-5 form (``rope_parameters``, ``dtype``), or Hub form
    model.safetensors       every tensor the architecture needs, Hugging Face names
    tokenizer.json          byte-level BPE from :mod:`kvserve.model.tokenizer_builder`, or copied
    tokenizer_config.json   from ``tokenizer_dir``; with a ChatML chat template

Weights are initialised the way transformers initialises these models: linear and embedding
matrices ~ N(0, 0.02), norm weights 1, biases 0. Each tensor has its own generator seeded from
``(seed, tensor name)``, so a tensor's values depend only on the seed, its name and its shape.
Both kvserve and transformers' ``AutoModelForCausalLM`` load the result.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvserve.config import ModelConfig
from kvserve.model.loader import checkpoint_tensor_shapes, torch_dtype
from kvserve.model.presets import ModelPreset, get_preset
from kvserve.model.tokenizer_builder import SPECIAL_TOKENS, write_tokenizer

INIT_STD = 0.02
CONFIG_FORMS = ("transformers5", "hub")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
ENDOFTEXT = SPECIAL_TOKENS[0]


def to_hub_form(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a transformers-5 config dict in the form Hub checkpoints carry:
    ``rope_parameters`` -> ``rope_theta`` + ``rope_scaling``; ``dtype`` -> ``torch_dtype``."""
    out = dict(cfg)
    rope = dict(out.pop("rope_parameters", None) or {})
    out["rope_theta"] = rope.pop("rope_theta", 10000.0)
    out["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    if "dtype" in out:
        out["torch_dtype"] = out.pop("dtype")
    return out


def init_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """HF-style init: norms 1, biases 0, everything else N(0, INIT_STD) from a per-name generator."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name:
        return torch.ones(shape, dtype=dtype)
    if leaf == "bias":
        return torch.zeros(shape, dtype=dtype)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return (torch.randn(shape, generator=gen) * INIT_STD).to(dtype)


def param_count(preset: ModelPreset) -> int:
    """Parameters of the checkpoint ``preset`` describes (a tied lm_head counted once)."""
    config = ModelConfig.from_hf_dict(preset.hf_config())
    total = 0
    for shape in checkpoint_tensor_shapes(config).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def copy_tokenizer(src: str | Path, out: Path) -> int:
    """Copy ``tokenizer.json`` + ``tokenizer_config.json`` from ``src``; returns its vocabulary size."""
    from tokenizers import Tokenizer

    src = Path(src)
    for name in TOKENIZER_FILES:
        if not (src / name).exists():
            raise FileNotFoundError(f"tokenizer folder {src} has no {name}")
        shutil.copyfile(src / name, out / name)
    return int(Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size())


def eos_token_ids(root: Path) -> tuple[int, ...]:
    """Ids that end generation: the tokenizer config's ``eos_token`` then ``<|endoftext|>``, when present."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    eos = json.loads((root / "tokenizer_config.json").read_text()).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    ids = [tok.token_to_id(t) for t in (eos, ENDOFTEXT) if t]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def make_model(preset: str | ModelPreset, out: str | Path, seed: int = 0, dtype: str | None = None,
               config_form: str = "transformers5", force: bool = False,
               tokenizer_dir: str | Path | None = None) -> Path:
    """Write the checkpoint folder for ``preset`` to ``out`` and return its path.

    The tokenizer is built by :mod:`kvserve.model.tokenizer_builder` unless ``tokenizer_dir``
    names a folder to copy one from (its vocabulary must fit the preset's ``vocab_size``)."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    if config_form not in CONFIG_FORMS:
        raise ValueError(f"config_form must be one of {', '.join(CONFIG_FORMS)}, got {config_form!r}")
    root = Path(out)
    if root.exists() and not force and ((root / "config.json").exists() or any(root.glob("*.safetensors"))):
        raise ValueError(f"{root} already holds a checkpoint; pass --force to overwrite it")
    root.mkdir(parents=True, exist_ok=True)

    if tokenizer_dir is not None:
        tok_vocab = copy_tokenizer(tokenizer_dir, root)
    else:
        tok_vocab = write_tokenizer(root, model_max_length=p.max_position_embeddings)
    if p.vocab_size < tok_vocab:
        raise ValueError(f"preset {p.name} has vocab_size {p.vocab_size} < tokenizer vocabulary {tok_vocab}")
    cfg = p.hf_config(dtype=dtype, eos_token_ids=eos_token_ids(root))
    config = ModelConfig.from_hf_dict(cfg)  # validates the shape before any weight is made
    tdtype = torch_dtype(config.dtype)
    tensors = {name: init_tensor(name, tuple(shape), seed, tdtype)
               for name, shape in checkpoint_tensor_shapes(config).items()}
    for stale in root.glob("*.safetensors*"):  # an older (maybe sharded) checkpoint under --force
        stale.unlink()
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "model.safetensors").chmod(0o644)
    written = to_hub_form(cfg) if config_form == "hub" else cfg
    (root / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    return root
