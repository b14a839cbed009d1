"""Which slice of each checkpoint tensor one tensor-parallel rank holds, and the config it runs.

Megatron-style sharding of a Llama-family decoder over ``T`` ranks (rank ``r``)::

    q_proj, k_proj, v_proj   column-parallel: rows of heads  [r·H/T, (r+1)·H/T), [r·KVH/T, …)
    gate_proj, up_proj       column-parallel: rows           [r·I/T, (r+1)·I/T)
    o_proj, down_proj        row-parallel: the matching input columns; each rank's output is a
                             partial sum, added across ranks by one all-reduce
    o_proj bias              rank 0 only (the others hold zeros), so the all-reduce adds it once
    embedding, norms,        replicated
    q_norm/k_norm (per head)
    lm_head                  rank 0 only: the other ranks never compute logits

Query head ``h`` reads KV head ``h // (H/KVH)``; rank ``r``'s local query head ``j`` is global
``r·H/T + j`` and its KV head ``(r·H/T + j) // g = r·KVH/T + j // g``: the grouping is preserved
locally, so the attention code runs unchanged on ``H/T`` query and ``KVH/T`` KV heads.

Why the embedding and lm_head are not vocab-split: a vocab-split embedding needs an all-reduce
of ``[T, hidden]`` before the first layer and a vocab-split lm_head an all-gather of the logits
to rank 0 before sampling: two more collectives per step, and logits computed off rank 0 (not
built; docs/tensor-parallel.md measures what the unsplit lm_head costs rank 0 at decode).
"""

from __future__ import annotations

import dataclasses

from kvserve.config import ModelConfig


def check_divisible(config: ModelConfig, tp: int) -> None:
    """Raise ``ValueError`` (one line) unless ``tp`` divides the heads, KV heads and MLP width."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(config, name)
        if n % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide {name} ({n}); "
                             f"this model allows {', '.join(str(t) for t in allowed_sizes(config))}")


def allowed_sizes(config: ModelConfig) -> list[int]:
    """Every tensor-parallel size this model can be split into."""
    n = config.num_key_value_heads
    return [t for t in range(1, n + 1) if not (n % t or config.num_attention_heads % t
                                               or config.intermediate_size % t)]


def shard_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config one rank's model is built from: ``H/T`` heads, ``KVH/T`` KV heads, ``I/T`` MLP
    width; everything else (hidden size, head_dim, vocab, rope) unchanged."""
    check_divisible(config, tp)
    if tp == 1:
        return config
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // tp,
                               num_key_value_heads=config.num_key_value_heads // tp,
                               intermediate_size=config.intermediate_size // tp)


@dataclasses.dataclass(frozen=True)
class Slice:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of a checkpoint tensor; ``zero``:
    the rank holds zeros of that shape (a row-parallel bias off rank 0)."""

    dim: int
    start: int
    stop: int
    zero: bool = False


def shard_slice(name: str, config: ModelConfig, rank: int, tp: int) -> Slice | None:
    """The part of checkpoint tensor ``name`` rank ``rank`` holds; ``None``: all of it (replicated)."""
    leaf = name.rsplit(".", 2)
    if len(leaf) < 3:
        return None
    module, kind = leaf[-2], leaf[-1]
    d = config.head_dim
    widths = {"q_proj": config.num_attention_heads * d // tp, "k_proj": config.num_key_value_heads * d // tp,
              "v_proj": config.num_key_value_heads * d // tp, "gate_proj": config.intermediate_size // tp,
              "up_proj": config.intermediate_size // tp}
    if module in widths:
        w = widths[module]
        return Slice(0, rank * w, (rank + 1) * w)
    if module in ("o_proj", "down_proj"):
        if kind == "bias":  # [hidden]: added once, by rank 0
            return None if rank == 0 else Slice(0, 0, config.hidden_size, zero=True)
        w = (config.num_attention_heads * d if module == "o_proj" else config.intermediate_size) // tp
        return Slice(1, rank * w, (rank + 1) * w)
    return None
