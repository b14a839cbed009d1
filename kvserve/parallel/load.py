"""Load one tensor-parallel rank's shard of a checkpoint, and wire its all-reduces.

Each rank reads only its slices (safetensors' ``get_slice``: the rows or columns of
:func:`kvserve.parallel.shard.shard_slice`), so no rank ever holds the whole model. The model is
the ordinary :class:`~kvserve.model.llama.LlamaForCausalLM` built from the rank's
:func:`~kvserve.parallel.shard.shard_config`; afterwards every layer's attention and MLP are
wrapped in :class:`AllReduceOutput`, which adds the ranks' partial outputs (the row-parallel
``o_proj`` / ``down_proj``) before the residual add. Nothing in the model file changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvserve.config import ModelConfig
from kvserve.model import loader
from kvserve.model.cpu_gemm import PackedFp16MLP, fbgemm_fp16_available, pack_linears
from kvserve.model.llama import MLP, LlamaForCausalLM
from kvserve.model.registry import get_model_class
from kvserve.parallel.shard import shard_config, shard_slice

Reduce = Callable[[torch.Tensor], None]  # in place: the sum over ranks


class AllReduceOutput(nn.Module):
    """``inner``'s output, summed over the ranks in place (the row-parallel projection's partial sums)."""

    def __init__(self, inner: nn.Module, reduce: Reduce) -> None:
        super().__init__()
        self.inner = inner
        self.reduce = reduce

    def forward(self, *args: object) -> torch.Tensor:
        out: torch.Tensor = self.inner(*args)
        self.reduce(out)
        return out


def _iter_shards(files: list[Path], config: ModelConfig, rank: int, tp: int) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name == "lm_head.weight" and rank != 0:
                    continue  # only rank 0 computes logits
                s = shard_slice(name, config, rank, tp)
                if s is None:
                    yield name, f.get_tensor(name)
                    continue
                part = f.get_slice(name)
                if s.zero:
                    yield name, torch.zeros(s.stop - s.start)
                elif s.dim == 0:
                    yield name, part[s.start:s.stop]
                else:
                    yield name, part[:, s.start:s.stop]


def load_shard(path: str | Path, rank: int, tp: int, reduce: Reduce, dtype: str = "auto",
               device: str | torch.device = "cpu", cpu_fp16_gemm: bool | None = None,
               ) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Rank ``rank``'s model (of ``tp``) and the full model's config. Ranks other than 0 have no
    logits projection (``lm_head`` is None and must not be called). ``reduce`` sums a tensor over
    the ranks in place."""
    root = Path(path)
    config = loader.load_model_config(root, dtype)
    files = loader.weight_files(root)
    shard = shard_config(config, tp)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(shard)
    if rank != 0 and not config.tie_word_embeddings:
        model.lm_head = None
    dev = torch.device(device)
    state = loader._read_state_dict(model, files, loader.torch_dtype(config.dtype), dev,
                                   tensors=_iter_shards(files, config, rank, tp))
    model.load_state_dict(state, strict=True, assign=True)
    del state
    model.to(dev)
    model.eval()
    model.requires_grad_(False)
    if cpu_fp16_gemm is None:
        cpu_fp16_gemm = dev.type == "cpu" and config.dtype in ("bfloat16", "float16") and fbgemm_fp16_available()
    if cpu_fp16_gemm and rank == 0:
        model.pack_cpu_fp16_gemm()
        loader._map_embedding(model, files)
    elif cpu_fp16_gemm:  # the layers only: no logits projection off rank 0
        for layer in model.model.layers:
            if isinstance(layer.mlp, MLP) and PackedFp16MLP.fits(layer.mlp.gate_up_proj.weight,
                                                                 layer.mlp.down_proj.weight):
                layer.mlp = PackedFp16MLP(layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight)
        pack_linears(model.model)
    for layer in model.model.layers:
        layer.self_attn = AllReduceOutput(layer.self_attn, reduce)
        layer.mlp = AllReduceOutput(layer.mlp, reduce)
    return model, config
