"""Load a Hugging Face checkpoint folder from local disk into :class:`LlamaForCausalLM`.

A checkpoint folder holds ``config.json`` (Hub form or transformers-5 form, both read by
:meth:`ModelConfig.from_hf_dict`) and weights as ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. The model is built on the ``meta`` device (no memory), then each
checkpoint tensor is read, cast to the target dtype, fused where the model fuses projections
(q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``) and assigned. Every expected tensor must be
present and every tensor present must be expected; errors name them.

The loader never changes global torch settings (threads, default dtype): the engine owns those.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvserve.config import ModelConfig, normalize_dtype
from kvserve.model import huge_pages
from kvserve.model.cpu_gemm import fbgemm_fp16_available
from kvserve.model.gemm_apply import apply_plan, lm_head_reads_embedding, model_roles
from kvserve.model.gemm_plan import plan_for
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.memory_release import release_free_memory
from kvserve.model.registry import get_model_class
from kvserve.model.safetensors_read import read_tensors
from kvserve.native import extensions

INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the model recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_MAX_NAMES_IN_ERROR = 8

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class CheckpointTensor:
    """Where one checkpoint tensor goes: ``model_key`` (a model parameter) at rows
    ``[row_start, row_start + shape[0])`` of it (non-zero only for fused projections)."""

    name: str
    shape: tuple[int, ...]
    model_key: str
    row_start: int


def torch_dtype(name: str) -> torch.dtype:
    """``bf16``/``bfloat16``/``torch.bfloat16``… -> the torch dtype."""
    return _TORCH_DTYPES[normalize_dtype(name)]


def checkpoint_layout(model: LlamaForCausalLM) -> dict[str, CheckpointTensor]:
    """Every tensor name a checkpoint for ``model`` must hold, with its shape and destination.

    Works on a meta-device model (only shapes are read).
    """
    packed = model.packed_modules()
    layout: dict[str, CheckpointTensor] = {}
    for key, tensor in model.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        parent, _, module = prefix.rpartition(".")
        if module not in packed:
            layout[key] = CheckpointTensor(key, tuple(tensor.shape), key, 0)
            continue
        row = 0
        for part, rows in packed[module]:
            name = f"{parent}.{part}.{leaf}"
            layout[name] = CheckpointTensor(name, (rows, *tensor.shape[1:]), key, row)
            row += rows
        if row != tensor.shape[0]:
            raise AssertionError(f"packed parts of {key} cover {row} rows, tensor has {tensor.shape[0]}")
    return layout


def checkpoint_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes for ``config`` (Hugging Face naming), without allocating."""
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    return {name: t.shape for name, t in checkpoint_layout(model).items()}


def weight_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards its index names, else ``*.safetensors``."""
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index ({exc})") from None
        files = [root / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise FileNotFoundError(f"{index} names shard(s) missing from {root}: {', '.join(absent)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" (found {', '.join(other)}: only safetensors weights are supported)" if other else ""
        raise FileNotFoundError(f"no *.safetensors weights in {root}{hint}")
    return files


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        yield from read_tensors(file)


def _name_list(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:_MAX_NAMES_IN_ERROR])
    more = len(names) - _MAX_NAMES_IN_ERROR
    return shown + (f" and {more} more" if more > 0 else "")


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, a new buffer on huge pages where it may be (:mod:`kvserve.model.huge_pages`)."""
    if tensor.dtype == dtype or tensor.device.type != "cpu":
        return tensor.to(dtype)
    return huge_pages.empty(tuple(tensor.shape), dtype).copy_(tensor)


def _read_state_dict(model: LlamaForCausalLM, files: list[Path], dtype: torch.dtype, device: torch.device,
                     tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """Read, cast, fuse. Fused parameters are assembled as soon as all their parts arrived.
    ``tensors``: the checkpoint's tensors as read (default: all of ``files``; a tensor-parallel
    rank passes its slices, :mod:`kvserve.parallel.load`)."""
    layout = checkpoint_layout(model)
    parts_left: dict[str, int] = {}
    for entry in layout.values():
        parts_left[entry.model_key] = parts_left.get(entry.model_key, 0) + 1
    pending: dict[str, list[tuple[int, torch.Tensor]]] = {}
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    seen: set[str] = set()
    for name, tensor in _iter_tensors(files) if tensors is None else tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # some tied checkpoints store the shared matrix twice
        spec = layout.get(name)
        if spec is None:
            unexpected.append(name)
            continue
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {spec.shape}")
        seen.add(name)
        # read into its own buffer (never a view of a mapping of the file: see safetensors_read)
        pending.setdefault(spec.model_key, []).append((spec.row_start, _cast(tensor, dtype)))
        parts_left[spec.model_key] -= 1
        if parts_left[spec.model_key] == 0:
            parts = [t for _, t in sorted(pending.pop(spec.model_key), key=lambda p: p[0])]
            full = parts[0] if len(parts) == 1 else torch.cat(
                parts, dim=0, out=huge_pages.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype))
            state[spec.model_key] = full.to(device)
    missing = [n for n in layout if n not in seen]
    if missing or unexpected:
        msg = []
        if missing:
            msg.append(f"missing {len(missing)} tensor(s): {_name_list(missing)}")
        if unexpected:
            msg.append(f"unexpected {len(unexpected)} tensor(s): {_name_list(unexpected)}")
        raise ValueError(
            f"checkpoint does not match {model.config.architecture} built from its config.json; "
            + "; ".join(msg)
        )
    return state


def load_model_config(path: str | Path, dtype: str = "auto") -> ModelConfig:
    """The checkpoint's :class:`ModelConfig` with the dtype it will be loaded in (no weights read)."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"model path {root} does not exist")
    if not root.is_dir():
        raise FileNotFoundError(f"model path {root} is not a folder; pass a Hugging Face checkpoint folder")
    config = ModelConfig.from_path(root)
    if dtype != "auto":
        config = dataclasses.replace(config, dtype=normalize_dtype(dtype))
    return config


def load_model(path: str | Path, dtype: str = "auto", device: str | torch.device = "cpu",
               cpu_fp16_gemm: bool | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for the checkpoint at ``path`` and load its weights (inference mode, no grad).

    ``dtype="auto"`` keeps the checkpoint's dtype (``config.json``'s ``dtype``/``torch_dtype``);
    otherwise weights are cast. The returned config's ``dtype`` is the dtype actually loaded.

    ``cpu_fp16_gemm``: ``None`` (default) runs each projection of a CPU model on the GEMM path
    measured fastest for this machine, per row band (:mod:`kvserve.model.gemm_plan`: torch's
    native matmul or FBGEMM's fp16-weight GEMM; measured before the weights are read, so its
    scratch memory is gone before they arrive); ``True`` forces FBGEMM fp16 everywhere, ``False``
    torch's native matmul. On a CPU every native kernel is built (or loaded from its cache) first,
    :func:`kvserve.native.extensions.prebuild`.
    """
    root = Path(path)
    config = load_model_config(root, dtype)
    files = weight_files(root)
    model_cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = model_cls(config)
    dev = torch.device(device)
    if cpu_fp16_gemm and dev.type != "cpu":
        raise ValueError(f"cpu_fp16_gemm needs device cpu, got {dev}")
    if cpu_fp16_gemm and not fbgemm_fp16_available():
        raise ValueError("cpu_fp16_gemm: this torch build has no FBGEMM fp16 GEMM")
    plan = None
    if dev.type == "cpu":
        extensions.prebuild()  # every native kernel now, side by side: none is left to a request
        forced = {None: None, True: "fbgemm_fp16", False: "native"}[cpu_fp16_gemm]
        plan = plan_for(model_roles(model), torch_dtype(config.dtype), forced)
        release_free_memory()
    state = _read_state_dict(model, files, torch_dtype(config.dtype), dev)
    model.load_state_dict(state, strict=True, assign=True)
    del state  # the parameters are these tensors: packing below frees each one as it replaces it
    model.to(dev)  # the rope buffer (built on CPU) follows the weights
    model.eval()
    model.requires_grad_(False)
    if plan is not None and plan.swaps_modules():
        apply_plan(model, plan)
        _map_embedding(model, files)
        release_free_memory()
    return model, config


def _map_embedding(model: LlamaForCausalLM, files: list[Path]) -> None:
    """Once the logits projection is packed (or is a matrix of its own), the embedding is only
    looked up by rows: read it in place from the checkpoint (:mod:`kvserve.model.mapped_tensor`),
    so only the rows requests touch are resident, instead of a second resident copy of the
    vocab x hidden matrix next to the packed one. Left as is when the file stores it in another
    dtype."""
    from kvserve.model.mapped_tensor import map_tensor

    emb = model.model.embed_tokens
    if lm_head_reads_embedding(model):
        return
    mapped = map_tensor(files, "model.embed_tokens.weight", emb.weight.dtype)
    if mapped is not None and mapped.shape == emb.weight.shape:
        emb.weight = torch.nn.Parameter(mapped, requires_grad=False)


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's tokenizer (and chat template) via transformers, from local files only."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"model path {root} does not exist")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"no usable tokenizer in {root} (need tokenizer.json / tokenizer_config.json): {exc}") \
            from None
