"""How many bytes a token of KV costs, and what a memory budget buys.

This is the one function the engine and the planner share: what ``kvserve plan`` predicts for a
budget is what the engine allocates. Pure Python, no torch.

    bytes/token = 2 (K and V) × layers × kv_heads × (head_dim × element bytes + scale bytes)

Codecs that store scales (fp8, int8, int4) add their per-token, per-KV-head scale overhead, so
the count equals the storage tensors' size. A per-layer map (``layers:…``,
:mod:`kvserve.kv.codec_names`) sums each layer's own K and V bytes: a block still spans every
layer, so the pool counts whole blocks of the summed size.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ModelConfig
from kvserve.kv.codec_names import (
    FLOAT_CODECS,
    is_layer_map,
    parse_layer_codecs,
    resolve_kv_dtype,
    split_kv_dtype,
)
from kvserve.kv.press.window import peak_blocks

__all__ = ["FLOAT_KV_DTYPES", "KV_DTYPES", "resolve_kv_dtype", "split_kv_dtype"]


@dataclass(frozen=True)
class KVDtype:
    """Storage cost of one KV element and the scale bytes per (token, KV head) of K or V."""

    name: str
    element_bits: int
    scale_bytes_per_head: float  # per token, per KV head, for K or for V

    def bytes_per_head(self, head_dim: int) -> float:
        """Bytes one token's K (or V) costs in one KV head, scales included."""
        return head_dim * self.element_bits / 8 + self.scale_bytes_per_head


# int4 (KIVI-style): values carry an fp16 scale + zero per token per head (4 bytes); keys carry
# an fp16 scale + zero per channel over a group of G tokens (4 × head_dim / G bytes per token).
# ``int4_scale_bytes`` is the average of the two sides per tensor. The engine's group is
# ``int4_group_size(block_size)`` (a group never straddles a block), 32 for blocks of 32 or more.
DEFAULT_INT4_GROUP = 32


def int4_scale_bytes(head_dim: int, group_size: int = DEFAULT_INT4_GROUP) -> float:
    """Average scale bytes per token per KV head for K and V under the KIVI-style int4 codec."""
    value_side = 4.0
    key_side = 4.0 * head_dim / group_size
    return (value_side + key_side) / 2


def int4_group_size(block_size: int, requested: int | None = None) -> int:
    """int4's key group: ``requested``, else ``min(32, block_size)``. It must divide the block."""
    group = requested if requested is not None else min(DEFAULT_INT4_GROUP, block_size)
    if group <= 0 or block_size % group:
        raise ValueError(f"int4 key group size {group} must be > 0 and divide block_size {block_size}")
    return group


KV_DTYPES: dict[str, KVDtype] = {
    "float32": KVDtype("float32", 32, 0.0),
    "bfloat16": KVDtype("bfloat16", 16, 0.0),
    "float16": KVDtype("float16", 16, 0.0),
    "fp8": KVDtype("fp8", 8, 4.0),   # e4m3 + one fp32 scale per token per head
    "int8": KVDtype("int8", 8, 4.0),  # symmetric, one fp32 scale per token per head
    "int4": KVDtype("int4", 4, 0.0),  # scales depend on head_dim: see int4_scale_bytes
}
FLOAT_KV_DTYPES: tuple[str, ...] = FLOAT_CODECS


def side_bytes_per_head(name: str, side: str, head_dim: int, group_size: int) -> float:
    """Bytes per token per KV head of one side (K or V) under codec ``name``."""
    spec = KV_DTYPES[name]
    data = head_dim * spec.element_bits / 8
    if name != "int4":
        return data + spec.scale_bytes_per_head
    return data + (4.0 * head_dim / group_size if side == "k" else 4.0)


def side_block_bytes(name: str, side: str, block_size: int, kv_heads: int, head_dim: int,
                     group_size: int | None = None) -> int:
    """Exact bytes one block of one side costs in one layer: the codec's fields
    (:mod:`kvserve.kv.quant`), padded to a multiple of 4 bytes."""
    group = int4_group_size(block_size, group_size)
    total = block_size * kv_heads * side_bytes_per_head(name, side, head_dim, group)
    return -(-int(total) // 4) * 4


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str, block_size: int,
                   group_size: int | None = None) -> int:
    """Exact bytes one block (``block_size`` tokens, K and V, all layers) costs, padded to a
    multiple of ``block_size`` so that bytes per token is a whole number."""
    total = sum(layer_block_bytes(num_kv_heads, head_dim, kv_dtype, block_size, group_size, num_layers))
    return -(-total // block_size) * block_size


def layer_block_bytes(num_kv_heads: int, head_dim: int, kv_dtype: str, block_size: int,
                      group_size: int | None, num_layers: int) -> list[int]:
    """Each layer's bytes of one block (its K region + V region), in layer order."""
    return [side_block_bytes(p.k, "k", block_size, num_kv_heads, head_dim, group_size)
            + side_block_bytes(p.v, "v", block_size, num_kv_heads, head_dim, group_size)
            for p in parse_layer_codecs(resolve_kv_dtype(kv_dtype), num_layers=num_layers)]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str = "bfloat16",
                       group_size: int = DEFAULT_INT4_GROUP) -> int:
    """Bytes of KV cache one token holds across all layers: 2 × layers × kv_heads × head_dim × bytes
    (plus codec scales). Rounded up to whole bytes. ``group_size`` is int4's key group; the
    engine's exact figure for a block size is :func:`kv_block_bytes` ``/ block_size``."""
    if min(num_layers, num_kv_heads, head_dim) <= 0:
        raise ValueError("layers, kv_heads and head_dim must all be > 0")
    total = num_kv_heads * sum(side_bytes_per_head(p.k, "k", head_dim, group_size)
                               + side_bytes_per_head(p.v, "v", head_dim, group_size)
                               for p in parse_layer_codecs(resolve_kv_dtype(kv_dtype), num_layers=num_layers))
    return int(-(-total // 1))


def mla_kv_bytes_per_token(
    num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, kv_dtype: str = "bfloat16"
) -> int:
    """Bytes one token costs under multi-head latent attention (DeepSeek-V2/V3).

    MLA caches one compressed latent (``kv_lora_rank`` wide) plus one shared RoPE key
    (``qk_rope_head_dim`` wide) per token per layer, shared by every head, so there is no factor 2
    and no head count: (kv_lora_rank + qk_rope_head_dim) × layers × element bytes, plus the codec's
    scales counted as for one "head" of that width. Rounded up to whole bytes.
    """
    if min(num_layers, kv_lora_rank, qk_rope_head_dim) <= 0:
        raise ValueError("layers, kv_lora_rank and qk_rope_head_dim must all be > 0")
    spec = KV_DTYPES[resolve_kv_dtype(kv_dtype)]
    width = kv_lora_rank + qk_rope_head_dim
    per_layer = spec.bytes_per_head(width)
    if spec.name == "int4":
        per_layer += int4_scale_bytes(width)
    return int(-(-(num_layers * per_layer) // 1))


@dataclass(frozen=True)
class KVCapacity:
    """What a memory budget buys: learned at start-up, never written back into a config.

    Invariant: ``allocated_bytes <= budget_bytes``, where ``allocated_bytes`` is the blocks
    (``num_blocks * block_size * bytes_per_token``) plus the full-precision window that lossy KV
    codecs keep (``window_blocks * window_block_bytes``; 0 for float KV). It equals the byte size
    of the storage tensors.
    """

    num_blocks: int
    block_size: int
    bytes_per_token: int
    budget_bytes: int
    max_model_len: int
    window_blocks: int = 0
    window_block_bytes: int = 0
    sliding_window: int | None = None  # the model's (every layer's): blocks behind it are freed

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def window_bytes(self) -> int:
        return self.window_blocks * self.window_block_bytes

    @property
    def allocated_bytes(self) -> int:
        return self.token_capacity * self.bytes_per_token + self.window_bytes

    @property
    def blocks_per_max_len_seq(self) -> int:
        """Blocks a decoding sequence of ``max_model_len`` tokens holds at most (its window's
        span for a windowed model: :func:`kvserve.kv.press.peak_blocks`)."""
        return peak_blocks(self.max_model_len, self.block_size, self.sliding_window)

    @property
    def max_concurrency_at_max_len(self) -> float:
        """How many sequences of ``max_model_len`` tokens fit at once (may be fractional)."""
        return self.num_blocks / self.blocks_per_max_len_seq

    def summary(self) -> str:
        gib = self.allocated_bytes / 2**30
        window = ""
        if self.window_blocks:
            window = (f" (incl. a full-precision window of {self.window_blocks} blocks, "
                      f"{self.window_bytes / 2**20:.1f} MiB)")
        return (
            f"KV cache: {self.num_blocks} blocks × {self.block_size} tokens = {self.token_capacity} tokens, "
            f"{self.bytes_per_token} bytes/token, {gib:.3f} GiB{window}; max concurrency at "
            f"max_model_len={self.max_model_len}: {self.max_concurrency_at_max_len:.2f}"
        )


def capacity_for_budget(budget_bytes: int, bytes_per_token: int, block_size: int, max_model_len: int,
                        window_blocks: int = 0, window_block_bytes: int = 0,
                        sliding_window: int | None = None) -> KVCapacity:
    """The number of whole blocks a budget buys after the full-precision window (if any) is set
    aside. Raises if it buys none."""
    if budget_bytes <= 0:
        raise ValueError(f"KV budget must be > 0 bytes, got {budget_bytes}")
    block_bytes = bytes_per_token * block_size
    window = window_blocks * window_block_bytes
    num_blocks = (budget_bytes - window) // block_bytes
    if window and num_blocks <= 0:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes leaves no room for blocks after the full-precision "
            f"window of {window_blocks} blocks ({window} bytes); raise kv_cache_memory or lower "
            f"kv_quant_min_tokens / max_num_seqs"
        )
    if num_blocks <= 0:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes is smaller than one block ({block_bytes} bytes = "
            f"{block_size} tokens × {bytes_per_token} bytes/token); raise kv_cache_memory"
        )
    return KVCapacity(num_blocks, block_size, bytes_per_token, budget_bytes, max_model_len,
                      window_blocks, window_block_bytes if window_blocks else 0, sliding_window)


def model_kv_bytes_per_token(model: ModelConfig, kv_dtype: str = "auto", block_size: int | None = None,
                             group_size: int | None = None) -> int:
    """:func:`kv_bytes_per_token` for a model config; ``auto`` follows the model's dtype.

    With ``block_size`` the figure is the engine's exact one, :func:`kv_block_bytes` ``/ block_size``
    (int4's key group is then ``int4_group_size(block_size, group_size)``); without, int4 assumes
    groups of 32 (the same figure whenever the block holds a whole number of 32-token groups)."""
    name = resolve_kv_dtype(kv_dtype, model.dtype)
    if block_size is None:
        return kv_bytes_per_token(model.num_hidden_layers, model.num_key_value_heads, model.head_dim, name,
                                  group_size or DEFAULT_INT4_GROUP)
    block = kv_block_bytes(model.num_hidden_layers, model.num_key_value_heads, model.head_dim, name,
                           block_size, group_size)
    return block // block_size


# -- the full-precision window of lossy codecs ---------------------------------------------------
#
# A lossy pool keeps some blocks in the model dtype too ("shadows", see kvserve.kv.storage):
# every block of a sequence shorter than ``kv_quant_min_tokens`` (it reads full precision until it
# crosses the threshold), and, under int4, the block holding a sequence's unfinished key group and
# its first "sink" tokens. The area is sized so that every running sequence can have all of them:
#
#     window blocks = max_num_seqs × (⌈min_tokens / block_size⌉ + 3 if int4 keys or sinks else ⌈min_tokens / block_size⌉)
#
# (3 = the unfinished group's block, the previous block while it is finished, and the sink block).

def _distinct_pairs(kv_dtype: str) -> list[tuple[str, str]]:
    name = resolve_kv_dtype(kv_dtype)
    if is_layer_map(name):
        return sorted({(p.k, p.v) for p in parse_layer_codecs(name)})
    return [split_kv_dtype(name)]


def needs_tail_window(kv_dtype: str, sink_tokens: int = 0) -> bool:
    """True when the codec keeps each sequence's unfinished key group (int4 keys) or its first
    ``sink_tokens`` tokens (int4 on either side) in full precision; for a per-layer map, when any
    layer's pair does (the window then holds every layer of those blocks)."""
    return any(k == "int4" or (sink_tokens > 0 and "int4" in (k, v)) for k, v in _distinct_pairs(kv_dtype))


def window_blocks(kv_dtype: str, block_size: int, max_num_seqs: int, min_tokens: int,
                  sink_tokens: int = 0) -> int:
    """Blocks of the full-precision window for a pool (0 for float KV; a per-layer map has one when
    any layer is lossy). See the formula above."""
    if all(k in FLOAT_KV_DTYPES and v in FLOAT_KV_DTYPES for k, v in _distinct_pairs(kv_dtype)):
        return 0
    per_seq = -(-min_tokens // block_size) + (3 if needs_tail_window(kv_dtype, sink_tokens) else 0)
    return max_num_seqs * per_seq


def window_block_bytes(model: ModelConfig, block_size: int) -> int:
    """Bytes of one window block: K and V of ``block_size`` tokens, all layers, in the model dtype."""
    return block_size * kv_bytes_per_token(model.num_hidden_layers, model.num_key_value_heads,
                                           model.head_dim, model.dtype)
