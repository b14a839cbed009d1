"""Pure translation of a scheduling decision into the model's input tensors.

For each scheduled chunk (request, tokens ``start..end-1``) this lays out::

    input_ids  | chunk0 tokens | chunk1 tokens | ...      flat, no padding     [T]
    positions  | start0..end0-1 | start1..end1-1 | ...                         [T]
    slots      block_ids[p // block_size] * block_size + p % block_size        [T]
    logits_indices  index in T of each sampled position (the chunk's last num_sample)  [S]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.contract import ScheduledChunk
from kvserve.model.attention import AttentionMetadata
from kvserve.model.attention_backends import AttentionBackend
from kvserve.runner.state import RequestState


@dataclass(frozen=True)
class SampleRow:
    """One sampled position: the request's state and the output index the new token takes."""

    state: RequestState
    output_index: int


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_rows: list[SampleRow]
    sample_counts: list[int]  # per chunk, in order: how many of sample_rows belong to it


def slots_for(block_ids: Sequence[int | None], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots of positions ``start..end-1`` under ``block_ids`` (never a dropped entry)."""
    out: list[int] = []
    p = start
    while p < end:  # one run per block: positions p..stop-1 sit at b * block_size + p % block_size
        i = p // block_size
        b = block_ids[i]
        if b is None:
            raise ValueError(f"position {p} falls in a dropped block; a step never writes there")
        stop = min(end, (i + 1) * block_size)
        shift = (b - i) * block_size
        out.extend(range(p + shift, stop + shift))
        p = stop
    return out


def held_table(block_ids: Sequence[int | None]) -> tuple[list[int], frozenset[int]]:
    """The block table's ids (a dropped entry becomes block 0, never read) and the logical
    indices of the dropped entries."""
    if None not in block_ids:
        return list(block_ids), frozenset()  # type: ignore[arg-type]
    dropped = frozenset(i for i, b in enumerate(block_ids) if b is None)
    return [0 if b is None else b for b in block_ids], dropped


def build_inputs(chunks: Sequence[ScheduledChunk], states: dict[str, RequestState], block_size: int,
                 sliding_window: int | None, device: torch.device, backend: AttentionBackend | None = None,
                 kv_shape: tuple[int, ...] | None = None) -> ModelInputs:
    """The step's tensors, with the attention backend's plan built once for every layer."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    table_ids: list[int] = []
    table_lens: list[int] = []
    logits_indices: list[int] = []
    rows: list[SampleRow] = []
    counts: list[int] = []
    dropped: list[frozenset[int]] = []
    for c in chunks:
        state = states[c.request_id]
        ids.extend(state.token_ids[c.start:c.end])
        positions.extend(range(c.start, c.end))
        slots.extend(slots_for(c.block_ids, c.start, c.end, block_size))
        query_start.append(query_start[-1] + c.num_new_tokens)
        seq_lens.append(c.end)
        table, holes = held_table(c.block_ids)
        table_ids.extend(table)
        table_lens.append(len(table))
        dropped.append(holes)
        for j in range(c.num_sample):  # the chunk's last num_sample positions
            logits_indices.append(query_start[-1] - c.num_sample + j)
            rows.append(SampleRow(state, c.end - c.num_sample + j + 1 - state.num_prompt_tokens))
        counts.append(c.num_sample)
    # one tensor for the four index vectors and every block table (one allocation and one copy a
    # step, not one per sequence); views of it
    flat = torch.tensor(ids + positions + slots + logits_indices + table_ids, dtype=torch.long, device=device)
    n = len(ids)
    input_ids, position_t, slot_t, logits_t, *tables = flat.split([n, n, n, len(logits_indices), *table_lens])
    meta = AttentionMetadata(
        slot_mapping=slot_t,
        query_start_loc=query_start,
        seq_lens=seq_lens,
        block_tables=tables,
        block_size=block_size,
        sliding_window=sliding_window,
    )
    if any(dropped) or any(c.window is not None or c.sinks or c.score_queries for c in chunks):
        meta.seq_windows = [c.window for c in chunks]
        meta.seq_sinks = [c.sinks for c in chunks]
        meta.dropped = dropped
        meta.score_queries = [c.score_queries for c in chunks]
    if backend is not None and kv_shape is not None:
        meta.backend = backend
        meta.plan = backend.plan(meta, kv_shape, device)
    return ModelInputs(
        input_ids=input_ids,
        positions=position_t,
        meta=meta,
        logits_indices=logits_t,
        sample_rows=rows,
        sample_counts=counts,
    )
