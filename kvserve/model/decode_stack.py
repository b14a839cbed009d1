"""Every decoder layer of a small step in one native call (``csrc/decode_stack.cpp``).

A decode step of the 0.5B shape crossed from Python into C++ ~1,000 times (24 layers of norms,
projections, rope, attention, SiLU·mul, adds), while the second OpenMP thread waited for the next
parallel call. :func:`run_layers` hands the whole layer loop to one C++ function that calls the
same kernels in the same order, so its hidden states are bit-equal to the per-layer path's
(tests/engine/test_decode_stack.py); on the 2-core Zen 4 EPYC a decode step took 0.85x the
per-layer path's time at one sequence and 0.93x at 16 (``python benchmarks/decode_stack.py``).

It runs when everything the loop would do is one of those kernels, and the caller runs the
per-layer path otherwise (:func:`run_layers` returns None):

* a CPU model with no per-head q/k norm, at most :data:`MAX_ROWS` tokens in the step;
* every projection of the step's row band on the tiled kernel (:mod:`kvserve.model.gemm_plan`),
  the MLP as :class:`~kvserve.model.tiled_gemm.TiledMLP`, with no forward hooks on any module
  (looked at once per model and band: :func:`forget` makes it look again);
* attention on the native backend's plan with no sequence on the torch path (sinks, dropped
  blocks, scores), every layer's KV a float pool in the model's dtype (written natively with
  rope, :func:`kvserve.native.fused.rope_write`) or a codec pool the kernel reads in one codec
  pair (int8, fp8, int4: rope natively, then the pool's own ``write`` called back per layer, or,
  where every layer's write is one joint int8 pair's, ``fused.int8_write`` natively);
* the fused ops and the stack built (``KVSERVE_NATIVE=0`` or a failed build: never), and not
  switched off by ``KVSERVE_DECODE_STACK=0``.

Invariant: when it returns a tensor, that tensor equals the per-layer loop's output and the pools
hold what the per-layer loop would have written.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from kvserve.kv.layer_kv import CodecLayerKV, LayerKV, PlainLayerKV
from kvserve.model import attention_native
from kvserve.model.attention import AttentionMetadata
from kvserve.model.gemm_paths import BandDispatch, band_of
from kvserve.model.tiled_gemm import TiledLinear, TiledMLP
from kvserve.native import extensions, fused
from kvserve.native.choices import KernelChoice, record

MAX_ROWS = 128
"""Steps of up to this many tokens (the tiled kernel's register bands, 64 until session 18: a chat
turn's 65-token chunk then ran layer by layer); longer chunks are compute, where Python's share is
small."""


def enabled() -> bool:
    return os.environ.get("KVSERVE_DECODE_STACK", "1").lower() not in ("0", "false", "no", "off")


@functools.cache
def _ext() -> ModuleType | None:
    mod = extensions.load(extensions.STACK)
    record(KernelChoice("decode_stack", f"rows<={MAX_ROWS}", "native" if mod is not None else "per-layer", {},
                        "default" if mod is not None else "fallback: the stack did not build"))
    return mod


def _on_band(mod: nn.Module, band: int) -> nn.Module:
    return mod.paths[mod.band_path[band]] if isinstance(mod, BandDispatch) else mod


def _has_hooks(model: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


@dataclass(frozen=True)
class StackSpec:
    """What the native loop needs of a model in one row band: every layer's weights in order
    (``decode_stack.cpp``'s kPerLayer a layer) and the shapes its modules hold (per rank)."""

    weights: list[torch.Tensor]
    heads: int
    kv_heads: int
    scale: float
    inter: int
    eps: float


def _layer_weights(layer: Any, band: int) -> list[torch.Tensor] | None:
    attn = layer.self_attn  # a tensor-parallel rank wraps it (and the MLP) in its all-reduce: not ours
    if not hasattr(attn, "qkv_proj") or getattr(attn, "q_norm", None) is not None:
        return None
    qkv, o, mlp = _on_band(attn.qkv_proj, band), _on_band(attn.o_proj, band), _on_band(layer.mlp, band)
    if not isinstance(mlp, TiledMLP):
        return None
    if not all(isinstance(m, TiledLinear) and m.out_dtype is None for m in (qkv, o, mlp.gate_up, mlp.down)):
        return None
    return [layer.input_layernorm.weight, qkv.weight, qkv.bias, o.weight, o.bias,
            layer.post_attention_layernorm.weight, mlp.gate_up.weight, mlp.down.weight]


def _spec(model: Any, band: int) -> StackSpec | None:
    """``model``'s spec for ``band`` (cached on the model), or None when some layer is not
    all-tiled there or a module has hooks (a profiler's: it must see each module)."""
    cache: dict[int, StackSpec | None] = model.__dict__.setdefault("_decode_stack_specs", {})
    if band not in cache:
        per = [_layer_weights(layer, band) for layer in model.model.layers]
        spec = None
        if per and not _has_hooks(model) and all(w is not None for w in per):
            first = model.model.layers[0]
            attn, norm = first.self_attn, first.input_layernorm
            spec = StackSpec([t for w in per for t in w], attn.num_heads, attn.num_kv_heads,  # type: ignore[union-attr]
                             attn.scale, _on_band(first.mlp, band).inter, norm.eps)
        cache[band] = spec
    return cache[band]


def forget(model: Any) -> None:
    """Drop ``model``'s cached specs: the next step looks at its modules (and hooks) again. A
    forward hook registered after a band's first step is only seen after this."""
    model.__dict__.pop("_decode_stack_specs", None)


def run_layers(model: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv_caches: Sequence[LayerKV | torch.Tensor], meta: AttentionMetadata) -> torch.Tensor | None:
    """The decoder layers of ``model`` over ``h [T, hidden]`` in one native call (see the module
    doc), or None: the caller runs them one by one."""
    t = h.shape[0]
    plan = meta.plan
    if (t > MAX_ROWS or h.device.type != "cpu" or not enabled() or not isinstance(plan, attention_native.NativePlan)
            or plan.kept or not plan.seqs or h.dtype not in attention_native.FLOAT_KIND):
        return None
    layout = _kv_layout(list(kv_caches), h, meta)
    if layout is None:
        return None
    spec = _spec(model, band_of(t))
    mod = _ext() if spec is not None else None
    if spec is None or mod is None or fused._ext() is None:
        return None
    pools, write, sources, (blocks, offsets, int8_views) = layout
    return mod.run_layers(h.contiguous(), cos, sin, spec.weights, pools, meta.slot_mapping, plan.q_start, plan.q_len,
                          plan.seq_len, plan.window, plan.tables, spec.scale, spec.heads, spec.kv_heads, spec.inter,
                          spec.eps, attention_native.Q_TILE, attention_native.IMPL, fused.silu_native_rows(h.dtype),
                          attention_native.FLOAT_KIND[h.dtype], write, sources, int8_views, blocks,
                          offsets)  # type: ignore[no-any-return]


_NO_INT8: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] = (torch.empty(0, dtype=torch.long),
                                                                  torch.empty(0, dtype=torch.long), [])


def _int8_writes(caches: list[CodecLayerKV]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Every layer's native int8 write (:meth:`CodecLayerKV.int8_write_args`, one set of slots for
    all), or :data:`_NO_INT8` when some layer's write is anything else."""
    args = [c.int8_write_args() for c in caches]
    if any(a is None for a in args):
        return _NO_INT8
    blocks, offsets, _ = args[0]  # type: ignore[misc]
    return blocks.contiguous(), offsets.contiguous(), [t for a in args for t in a[2]]  # type: ignore[index]


def _kv_layout(caches: list[LayerKV | torch.Tensor], h: torch.Tensor, meta: AttentionMetadata
               ) -> tuple[list[torch.Tensor], Any, list[tuple[Any, ...]], tuple[torch.Tensor, torch.Tensor,
                                                                             list[torch.Tensor]]] | None:
    """How the loop reaches each layer's KV: float pools in the model dtype (written natively), or
    codec pools the kernel reads (written natively where every layer's write is one joint int8
    pair's, else by the pool's own ``write``, called back per layer, as the per-layer path does);
    None for anything else (mixed codec pairs, other kinds)."""
    if all(isinstance(c, PlainLayerKV) and c.tensor.dtype == h.dtype for c in caches):
        return [c.tensor for c in caches], None, [], _NO_INT8  # type: ignore[union-attr]
    if not all(isinstance(c, CodecLayerKV) for c in caches):
        return None
    srcs = [attention_native.kv_source(c) for c in caches]  # type: ignore[arg-type]
    if any(src is None for src in srcs):
        return None
    shape = caches[0].shape
    sizes = h.new_empty((2, 0, shape[2], shape[3], shape[4]))  # the loop reads only its sizes

    def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        caches[layer].write(k, v, meta.slot_mapping)  # type: ignore[union-attr]

    return ([sizes] * len(caches), write,
            [(src.k_base, src.k_params, src.v_base, src.v_params, *src.shadow) for src in srcs],  # type: ignore[union-attr]
            _int8_writes(caches))  # type: ignore[arg-type]
