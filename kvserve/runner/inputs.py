"""Pure translation of a scheduling decision into the model's input tensors.

For each scheduled chunk (request, tokens ``start..end-1``) this lays out::

    input_ids  | chunk0 tokens | chunk1 tokens | ...      flat, no padding     [T]
    positions  | start0..end0-1 | start1..end1-1 | ...                         [T]
    slots      block_table[p // block_size] * block_size + p % block_size      [T]
    logits_indices  index in T of the last token of each chunk that samples    [S]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.model.attention import AttentionMetadata
from kvserve.request import Request
from kvserve.scheduler.output import ScheduledChunk


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_requests: list[Request]


def slots_for(block_table: tuple[int, ...], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots of positions ``start..end-1`` under ``block_table``."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_inputs(chunks: list[ScheduledChunk], block_size: int, sliding_window: int | None,
                 device: torch.device) -> ModelInputs:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    tables: list[torch.Tensor] = []
    logits_indices: list[int] = []
    sample_requests: list[Request] = []
    for c in chunks:
        ids.extend(c.token_ids)
        positions.extend(range(c.start, c.end))
        slots.extend(slots_for(c.block_table, c.start, c.end, block_size))
        query_start.append(query_start[-1] + c.num_new_tokens)
        seq_lens.append(c.end)
        tables.append(torch.tensor(c.block_table, dtype=torch.long))
        if c.sample:
            logits_indices.append(query_start[-1] - 1)
            sample_requests.append(c.request)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=query_start,
        seq_lens=seq_lens,
        block_tables=[t.to(device) for t in tables],
        block_size=block_size,
        sliding_window=sliding_window,
    )
    return ModelInputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
        sample_requests=sample_requests,
    )
