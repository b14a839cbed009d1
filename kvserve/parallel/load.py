"""Load one tensor-parallel rank's shard of a checkpoint, and wire its all-reduces.

Each rank reads only its slices (safetensors' ``get_slice``: the rows or columns of
:func:`kvserve.parallel.shard.shard_slice`), so no rank ever holds the whole model. The model is
the ordinary :class:`~kvserve.model.llama.LlamaForCausalLM` built from the rank's
:func:`~kvserve.parallel.shard.shard_config`; afterwards every layer's attention and MLP are
wrapped in :class:`AllReduceOutput`, which adds the ranks' partial outputs (the row-parallel
``o_proj`` / ``down_proj``) before the residual add. Nothing in the model file changes.

The projections then take the GEMM paths of the rank's plan (:mod:`kvserve.parallel.kernels`,
applied by :func:`kvserve.model.gemm_apply.apply_plan` as the single-process loader does). Off
rank 0 the embedding is only looked up by rows (no logits there), so it is read in place from the
checkpoint rather than held.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvserve.config import ModelConfig
from kvserve.model import loader
from kvserve.model.gemm_apply import apply_plan
from kvserve.model.gemm_plan import GemmPlan
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.mapped_tensor import map_tensor
from kvserve.model.memory_release import release_free_memory
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


def without_logits(plan: GemmPlan) -> GemmPlan:
    """``plan`` with a ``native`` logits role: what a rank without a logits projection runs (a
    packed path would build one from a tied embedding)."""
    return dataclasses.replace(plan, paths={**plan.paths, "lm_head": ("native", "native", "native")})


def load_shard(path: str | Path, rank: int, tp: int, reduce: Reduce, dtype: str = "auto",
               device: str | torch.device = "cpu", plan: GemmPlan | None = None,
               ) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Rank ``rank``'s model (of ``tp``) and the full model's config. Ranks other than 0 have no
    logits projection (``lm_head`` is None and must not be called). ``reduce`` sums a tensor over
    the ranks in place. ``plan``: the GEMM paths of the shard's projections
    (:func:`kvserve.parallel.kernels.rank_gemm_plan`; ``None``: as loaded, torch's matmul)."""
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
    if plan is not None and rank != 0:
        plan = without_logits(plan)
    if plan is not None and plan.swaps_modules():
        apply_plan(model, plan)
        if rank == 0:
            loader._map_embedding(model, files)
        release_free_memory()
    if rank != 0:  # no logits here: the embedding is only looked up by rows, whatever the plan
        _map_rows_only_embedding(model, files)
    for layer in model.model.layers:
        layer.self_attn = AllReduceOutput(layer.self_attn, reduce)
        layer.mlp = AllReduceOutput(layer.mlp, reduce)
    return model, config


def _map_rows_only_embedding(model: LlamaForCausalLM, files: list[Path]) -> None:
    """Read the embedding in place from the checkpoint (only the rows requests touch are resident)."""
    emb = model.model.embed_tokens
    mapped = map_tensor(files, "model.embed_tokens.weight", emb.weight.dtype)
    if mapped is not None and mapped.shape == emb.weight.shape:
        emb.weight = torch.nn.Parameter(mapped, requires_grad=False)
