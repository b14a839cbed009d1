"""Bytes of KV per token and per sequence, for every attention shape the planner knows.

    standard (MHA/GQA/MQA):  2 × layers × kv_heads × head_dim × bytes  (+ codec scales)
    MLA (DeepSeek):          (kv_lora_rank + qk_rope_head_dim) × layers × bytes
    sliding-window layers:   hold at most ``window`` tokens each
    per-layer patterns:      each group of layers is counted with its own window (Gemma 2)

The per-token figure of a model the engine runs is :func:`kvserve.kv.layout.model_kv_bytes_per_token`
itself, so the planner's pool sizes equal the engine's. Under tensor parallelism each GPU holds
``kv_heads / tp`` heads (one head, replicated, when tp > kv_heads); an MLA latent is replicated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvserve.config import ModelConfig
from kvserve.kv.codec_names import MAP_PREFIX, is_layer_map
from kvserve.kv.layout import (
    DEFAULT_INT4_GROUP,
    KV_DTYPES,
    int4_group_size,
    int4_scale_bytes,
    kv_bytes_per_token,
    mla_kv_bytes_per_token,
    model_kv_bytes_per_token,
    side_bytes_per_head,
    split_kv_dtype,
    window_blocks,
)
from kvserve.kv.press import peak_blocks
from kvserve.planner.inputs import Settings
from kvserve.planner.model_spec import ModelSpec


@dataclass(frozen=True)
class LayerGroup:
    """``num_layers`` layers that share a window; ``bytes_per_token`` counts them all (one GPU)."""

    num_layers: int
    window: int | None
    bytes_per_token: int


@dataclass(frozen=True)
class KVModel:
    """KV cost of one model at one KV dtype and tensor-parallel degree, on one GPU.

    Invariant: ``sum(g.bytes_per_token for g in groups) == bytes_per_token`` up to the one byte the
    rounding of a fractional per-token cost may add.
    """

    kv_dtype: str
    tp: int
    kv_heads_per_gpu: int
    bytes_per_token: int
    groups: tuple[LayerGroup, ...]
    formula: str

    def sequence_bytes(self, tokens: int) -> int:
        """Bytes one sequence of ``tokens`` tokens holds, each windowed layer capped at its window."""
        return sum(
            g.bytes_per_token * (tokens if g.window is None else min(tokens, g.window)) for g in self.groups
        )

    def sequence_block_bytes(self, tokens: int, block_size: int) -> int:
        """As :meth:`sequence_bytes`, in whole blocks, as the engine holds them: a windowed group
        holds the blocks its decode window spans at most (the engine frees those behind it;
        :func:`kvserve.kv.press.peak_blocks`), one more than the window's when it straddles one."""
        total = 0
        for g in self.groups:
            total += g.bytes_per_token * peak_blocks(tokens, block_size, g.window) * block_size
        return total

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer shares one (what the engine runs), else None."""
        windows = {g.window for g in self.groups}
        return next(iter(windows)) if len(windows) == 1 else None

    @property
    def bounded(self) -> bool:
        """True when every layer is windowed: a sequence's KV stops growing at the largest window."""
        return all(g.window is not None for g in self.groups)


def kv_heads_per_gpu(spec: ModelSpec, tp: int) -> int:
    """KV heads one GPU holds under tensor parallelism of degree ``tp``."""
    if spec.num_attention_heads % tp:
        raise ValueError(f"--tp {tp} must divide num_attention_heads ({spec.num_attention_heads})")
    if spec.mla is not None:
        return 1
    kv = spec.num_kv_heads
    if kv % tp == 0:
        return kv // tp
    if tp % kv == 0:
        return 1  # each GPU keeps a replica of one KV head
    raise ValueError(f"--tp {tp} must divide num_key_value_heads ({kv}) or be a multiple of it")


def _worker(config: ModelConfig, tp: int) -> ModelConfig:
    """The model config one tensor-parallel worker runs (``kv_heads / tp`` KV heads)."""
    return config if tp == 1 else dataclasses.replace(config, num_key_value_heads=config.num_key_value_heads // tp,
                                                      num_attention_heads=config.num_attention_heads // tp)


def _per_head_text(dtype: str, width: int, group: int = DEFAULT_INT4_GROUP) -> tuple[str, float]:
    k, v = split_kv_dtype(dtype)
    if k != v:  # different key and value codecs: the average of the two per-head costs
        per = (side_bytes_per_head(k, "k", width, group) + side_bytes_per_head(v, "v", width, group)) / 2
        return f"({k} K + {v} V) / 2 = {per:g} B", per
    spec = KV_DTYPES[dtype]
    scale = spec.scale_bytes_per_head + (int4_scale_bytes(width, group) if dtype == "int4" else 0.0)
    elem = spec.element_bits / 8
    elem_text = f"{elem:g} byte{'s' if elem != 1 else ''}"
    if scale:
        return f"({width} × {elem_text} + {scale:g} B scales)", width * elem + scale
    return f"{width} × {elem_text}", width * elem


def _map_runs(kv_dtype: str) -> str:
    """``layers:int8*2/int4`` -> ``2 × int8 + 1 × int4`` (layer order)."""
    runs = kv_dtype.removeprefix(MAP_PREFIX).split("/")
    return " + ".join(f"{r.partition('*')[2] or 1} × {r.partition('*')[0]}" for r in runs)


def _group_bytes(spec: ModelSpec, layers: int, heads: int, kv_dtype: str, group: int = DEFAULT_INT4_GROUP) -> int:
    if spec.mla is not None:
        return mla_kv_bytes_per_token(layers, spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim, kv_dtype)
    return kv_bytes_per_token(layers, heads, spec.head_dim, kv_dtype, group)


def build_kv_model(spec: ModelSpec, kv_dtype: str, tp: int = 1, window_cap: int | None = None,
                   block_size: int | None = None) -> KVModel:
    """KV cost of ``spec`` with canonical ``kv_dtype``; ``window_cap`` caps every layer's window
    (a KV eviction window the operator chooses; lossy for a model trained without one).
    ``block_size`` sets int4's key group as the engine does (``min(32, block_size)``)."""
    heads = kv_heads_per_gpu(spec, tp)
    group = int4_group_size(block_size) if block_size is not None else DEFAULT_INT4_GROUP
    windows = [w if window_cap is None else min(w or window_cap, window_cap) for w in spec.layer_windows]
    counts: dict[int | None, int] = {}
    for w in windows:
        counts[w] = counts.get(w, 0) + 1
    if is_layer_map(kv_dtype) and (len(counts) > 1 or spec.mla is not None):
        raise ValueError("a per-layer KV map is planned for models whose layers share one window and no MLA")
    groups = tuple(
        LayerGroup(n, w, _group_bytes(spec, n, heads, kv_dtype, group))
        for w, n in sorted(counts.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))
    )
    if spec.engine_config is not None and spec.num_kv_heads % tp == 0:
        # the engine's own figure, for one worker's shard under tensor parallelism (kvserve.parallel)
        per_token = model_kv_bytes_per_token(_worker(spec.engine_config, tp), kv_dtype, block_size)
    else:
        per_token = _group_bytes(spec, spec.num_layers, heads, kv_dtype, group)
    if spec.mla is not None:
        width = spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim
        head_text, _ = _per_head_text(kv_dtype, width)
        formula = (
            f"({spec.mla.kv_lora_rank} kv_lora_rank + {spec.mla.qk_rope_head_dim} qk_rope_head_dim)"
            f" × {spec.num_layers} layers × {head_text.removeprefix(f'{width} × ')}"
            f" = {per_token:,} B/token (MLA latent, shared by all heads)"
        )
        if "scales" in head_text:
            formula = f"{spec.num_layers} layers × {head_text} = {per_token:,} B/token (MLA latent)"
    elif is_layer_map(kv_dtype):
        formula = f"{heads} KV heads × Σ layers [{_map_runs(kv_dtype)}] (K + V per head) = {per_token:,} B/token"
    else:
        head_text, _ = _per_head_text(kv_dtype, spec.head_dim, group)
        formula = (
            f"2 (K,V) × {spec.num_layers} layers × {heads} KV heads × {head_text} = {per_token:,} B/token"
        )
    for g in groups:
        if g.window is not None:
            formula += f"; {g.num_layers} layers windowed to {g.window:,} tokens"
    return KVModel(kv_dtype, tp, heads, per_token, groups, formula)


def fp_window_block_bytes(spec: ModelSpec, s: Settings, kv: KVModel) -> tuple[int, int]:
    """(blocks, bytes per block) of the full-precision window the engine sets aside for a lossy KV
    codec (:func:`kvserve.kv.layout.window_blocks`, at the engine's default ``kv_quant_min_tokens``);
    (0, 0) for float KV or MLA."""
    from kvserve.config import CacheConfig

    engine = CacheConfig()  # the engine's defaults: the planner has no quantization options
    blocks = window_blocks(s.kv_dtype, s.block_size, s.max_num_seqs, engine.kv_quant_min_tokens,
                           engine.kv_quant_sink_tokens)
    if not blocks or spec.mla is not None:
        return 0, 0
    float_dtype = s.weight_dtype if s.weight_dtype in ("float32", "bfloat16", "float16") else "bfloat16"
    return blocks, s.block_size * kv_bytes_per_token(spec.num_layers, kv.kv_heads_per_gpu, spec.head_dim, float_dtype)
