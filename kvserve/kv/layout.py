"""How many bytes a token of KV costs, and what a memory budget buys.

This is the one function the engine and the planner share: what ``kvserve plan`` predicts for a
budget is what the engine allocates. Pure Python, no torch.

    bytes/token = 2 (K and V) × layers × kv_heads × (head_dim × element bytes + scale bytes)

Codecs that store scales (fp8, int8, int4) add their per-token, per-KV-head scale overhead, so
the count equals the storage tensors' size.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ModelConfig


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
# With the default group of 32 and head_dim 64…128 that is 8…16 bytes; we count the key and value
# overheads together, halved per tensor, as an average per head. ``int4_scale_bytes`` computes it.
def int4_scale_bytes(head_dim: int, group_size: int = 32) -> float:
    """Average scale bytes per token per KV head for K and V under the KIVI-style int4 codec."""
    value_side = 4.0
    key_side = 4.0 * head_dim / group_size
    return (value_side + key_side) / 2


KV_DTYPES: dict[str, KVDtype] = {
    "float32": KVDtype("float32", 32, 0.0),
    "bfloat16": KVDtype("bfloat16", 16, 0.0),
    "float16": KVDtype("float16", 16, 0.0),
    "fp8": KVDtype("fp8", 8, 4.0),   # e4m3 + one fp32 scale per token per head
    "int8": KVDtype("int8", 8, 4.0),  # symmetric, one fp32 scale per token per head
    "int4": KVDtype("int4", 4, 0.0),  # scales depend on head_dim: see int4_scale_bytes
}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
            "float": "float32", "e4m3": "fp8", "fp8_e4m3": "fp8"}


def resolve_kv_dtype(name: str, model_dtype: str = "bfloat16") -> str:
    """Canonical KV dtype name; ``auto`` follows the model's dtype. Unknown names list the valid ones."""
    key = name.lower()
    if key == "auto":
        key = model_dtype
    key = _ALIASES.get(key, key)
    if key not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}; valid: auto, {', '.join(sorted(KV_DTYPES))}")
    return key


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str = "bfloat16") -> int:
    """Bytes of KV cache one token holds across all layers: 2 × layers × kv_heads × head_dim × bytes
    (plus codec scales). Rounded up to whole bytes."""
    if min(num_layers, num_kv_heads, head_dim) <= 0:
        raise ValueError("layers, kv_heads and head_dim must all be > 0")
    spec = KV_DTYPES[resolve_kv_dtype(kv_dtype)]
    per_head = spec.bytes_per_head(head_dim)
    if spec.name == "int4":
        per_head += int4_scale_bytes(head_dim)
    total = 2 * num_layers * num_kv_heads * per_head
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

    Invariant: ``num_blocks * block_size * bytes_per_token <= budget_bytes``.
    """

    num_blocks: int
    block_size: int
    bytes_per_token: int
    budget_bytes: int
    max_model_len: int

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def allocated_bytes(self) -> int:
        return self.token_capacity * self.bytes_per_token

    @property
    def blocks_per_max_len_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_concurrency_at_max_len(self) -> float:
        """How many sequences of ``max_model_len`` tokens fit at once (may be fractional)."""
        return self.num_blocks / self.blocks_per_max_len_seq

    def summary(self) -> str:
        gib = self.allocated_bytes / 2**30
        return (
            f"KV cache: {self.num_blocks} blocks × {self.block_size} tokens = {self.token_capacity} tokens, "
            f"{self.bytes_per_token} bytes/token, {gib:.3f} GiB; max concurrency at "
            f"max_model_len={self.max_model_len}: {self.max_concurrency_at_max_len:.2f}"
        )


def capacity_for_budget(budget_bytes: int, bytes_per_token: int, block_size: int, max_model_len: int) -> KVCapacity:
    """The number of whole blocks a budget buys. Raises if it buys none."""
    if budget_bytes <= 0:
        raise ValueError(f"KV budget must be > 0 bytes, got {budget_bytes}")
    block_bytes = bytes_per_token * block_size
    num_blocks = budget_bytes // block_bytes
    if num_blocks <= 0:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes is smaller than one block ({block_bytes} bytes = "
            f"{block_size} tokens × {bytes_per_token} bytes/token); raise kv_cache_memory"
        )
    return KVCapacity(num_blocks, block_size, bytes_per_token, budget_bytes, max_model_len)


def model_kv_bytes_per_token(model: ModelConfig, kv_dtype: str = "auto") -> int:
    """:func:`kv_bytes_per_token` for a model config; ``auto`` follows the model's dtype."""
    return kv_bytes_per_token(
        model.num_hidden_layers, model.num_key_value_heads, model.head_dim,
        resolve_kv_dtype(kv_dtype, model.dtype),
    )
