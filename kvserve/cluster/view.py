"""What the server reads of "the engine" (``state.engine.engine``) when the engines are replicas:
the tokenizer (loaded in the front end) and the replicas' shared figures. Frozen plain data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.cluster.replica import ReplicaInfo


@dataclass(frozen=True)
class ModelView:
    vocab_size: int


@dataclass(frozen=True)
class CapacityView:
    block_size: int
    num_blocks: int
    bytes_per_token: int
    token_capacity: int


@dataclass(frozen=True)
class EngineView:
    tokenizer: Any
    max_model_len: int
    model_config: ModelView
    capacity: CapacityView
    _eos: tuple[int, ...]

    @classmethod
    def of(cls, info: ReplicaInfo, tokenizer: Any) -> EngineView:
        return cls(tokenizer, info.max_model_len, ModelView(info.vocab_size),
                   CapacityView(info.block_size, info.num_blocks, info.bytes_per_token, info.token_capacity),
                   info.eos_ids)
