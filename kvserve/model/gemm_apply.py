"""Put a :class:`~kvserve.model.gemm_plan.GemmPlan` into a loaded Llama-family model.

Per role, a plan whose bands all name one path swaps the module for that path's (``native``:
the module is left as loaded); bands naming different paths get a
:class:`~kvserve.model.gemm_paths.BandDispatch` over one module per distinct path. A layer whose
weights do not fit fp16 keeps its native module (as before). A tied logits projection reads the
embedding itself on ``native`` and ``kvserve_tiled``; with every band on FBGEMM it gets its own
packed copy (the embedding itself is then only looked up by rows and can be mapped from the
checkpoint, see ``loader._map_embedding``).

Invariant: the model computes the same function before and after, up to fp32 summation order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvserve.model.gemm_paths import BandDispatch, NativeLinear, build_linear, build_mlp, path_fits
from kvserve.model.gemm_plan import GemmPlan
from kvserve.model.gemm_tune import RoleShape, role_shapes
from kvserve.model.memory_release import release_free_memory
from kvserve.model.tiled_gemm import TiledLinear


def model_roles(model: nn.Module) -> tuple[RoleShape, ...]:
    """The role shapes of a :class:`~kvserve.model.llama.LlamaForCausalLM` (from its config)."""
    c = model.config  # type: ignore[attr-defined]
    return role_shapes(c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim,
                       c.num_key_value_heads * c.head_dim, c.vocab_size, c.num_hidden_layers)


def _dispatch(bands: tuple[str, ...], make: Callable[[str], nn.Module]) -> nn.Module:
    names = list(dict.fromkeys(bands))
    mods = [make(p) for p in names]
    if len(mods) == 1:
        return mods[0]
    return BandDispatch(mods, tuple(names.index(b) for b in bands), bands)


def _linear(bands: tuple[str, ...], mod: nn.Linear, out_dtype: torch.dtype | None = None) -> nn.Module:
    if not all(path_fits(p, mod.weight) for p in bands):
        return mod
    if set(bands) == {"native"}:
        return mod
    return _dispatch(bands, lambda p: NativeLinear(mod.weight, mod.bias, out_dtype) if p == "native"
                     else build_linear(p, mod.weight, mod.bias, out_dtype))


def apply_plan(model: nn.Module, plan: GemmPlan) -> int:
    """Swap ``model``'s projections for the plan's paths (in place); returns how many roles'
    modules changed (0 for an all-native plan)."""
    from kvserve.model.llama import MLP

    changed = 0
    for layer in model.model.layers:  # type: ignore[attr-defined]
        attn = layer.self_attn
        for name, role in (("qkv_proj", "qkv"), ("o_proj", "o")):
            mod = getattr(attn, name)
            if isinstance(mod, nn.Linear):
                new = _linear(plan.paths[role], mod)
                changed += new is not mod
                setattr(attn, name, new)
        mlp, bands = layer.mlp, plan.paths["mlp"]
        if isinstance(mlp, MLP) and set(bands) != {"native"} and all(
                path_fits(p, mlp.gate_up_proj.weight, mlp.down_proj.weight) for p in bands):
            gu, dn = mlp.gate_up_proj.weight, mlp.down_proj.weight
            layer.mlp = _dispatch(bands, lambda p, gu=gu, dn=dn: build_mlp(p, gu, dn))
            changed += 1
        release_free_memory()  # this layer's freed bf16 matrices: heap pages glibc would keep (see memory_release)
    bands = plan.paths["lm_head"]
    if isinstance(model.lm_head, nn.Linear):  # type: ignore[attr-defined]
        new = _linear(bands, model.lm_head, torch.float32)  # type: ignore[attr-defined]
        changed += new is not model.lm_head  # type: ignore[attr-defined]
        model.lm_head = new
    elif model.lm_head is None and set(bands) != {"native"}:  # type: ignore[attr-defined]
        emb = model.model.embed_tokens.weight  # type: ignore[attr-defined]
        if all(path_fits(p, emb) for p in bands):
            model.lm_head = _dispatch(bands, lambda p: NativeLinear(emb, None, torch.float32)
                                      if p == "native" else build_linear(p, emb, None, torch.float32))
            changed += 1
    return changed


def lm_head_reads_embedding(model: nn.Module) -> bool:
    """Whether the logits still multiply by the embedding matrix itself (tied, some band native or
    on the tiled kernel, which both read the tensor as loaded)."""
    head = model.lm_head  # type: ignore[attr-defined]
    if head is None:
        return bool(model.config.tie_word_embeddings)  # type: ignore[attr-defined]
    mods = list(head.paths) if isinstance(head, BandDispatch) else [head]
    emb = model.model.embed_tokens.weight  # type: ignore[attr-defined]
    return any(isinstance(m, NativeLinear | TiledLinear) and m.weight is emb for m in mods)
