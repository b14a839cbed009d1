"""CUDA graphs for decode steps: one captured forward per (batch bucket, context bucket).

A decode step of a small model on a GPU is launch-bound: hundreds of small kernels, each a few
microseconds of work and as much again of launch. A CUDA graph launches them all at once. A graph
replays fixed shapes on fixed buffers, so a step whose every chunk is one decode token is padded
to a bucket: ``S`` sequences (the next power of two, at most :data:`MAX_SEQS`) and ``NB`` blocks a
table (the next power of two of the longest table, at least :data:`MIN_BLOCKS`). Each (S, NB) is
captured the first time a step needs it, with that step's own inputs already in the buffers (the
warm-up run writes exactly the K/V that the step writes, so it harms nothing), and replayed after.
All graphs share one memory pool. Attention runs :mod:`kvserve.model.attention_static`, its
variant chosen per batch bucket (:data:`MATMUL_MAX_SEQS`).

What takes the eager path instead (:meth:`DecodeGraphs.eligible`): any prefill or verify chunk,
drafts, a request-level window, sinks, scores or dropped blocks, a codec pool (fp8/int8/int4: the
layer views are not plain tensors), more than :data:`MAX_SEQS` sequences or tables longer than
``max_blocks``. ``KVSERVE_CUDA_GRAPHS=0`` turns graphs off (the runner then never builds this).

``capture=False`` runs the same fixed-shape forward without a graph: the CPU tests use it to check
the padding, the buffers and the static attention against the eager path's tokens.

Invariants: a replay reads only its own buffers and the KV pool; ``hidden`` rows past the step's
``n`` real rows are padding and never read; an entry's buffers are refilled before each replay.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.contract import ScheduledChunk
from kvserve.kv.layer_kv import PlainLayerKV
from kvserve.model.attention import AttentionMetadata
from kvserve.model.attention_static import VARIANTS, StaticDecodeBackend, static_plan

log = logging.getLogger("kvserve")
MAX_SEQS = 256
MIN_BLOCKS = 8
DEFAULT_ATTENTION = "auto"
MATMUL_MAX_SEQS = 1
"""``auto`` captures the ``matmul`` attention for batch buckets up to this, ``sdpa`` above: the
graph's replay on an H200 (0.5B shape, bf16, ``benchmarks/cuda_step_profile.py``) took 2.43 / 2.56
ms with ``matmul`` against 2.49 / 3.61 with ``sdpa`` for one decode at 512 / 2,048 context, and
3.82 / 7.25 against 3.22 / 6.05 ms for 16 (21.2 against 13.2 ms for 64 at 2,048)."""
_INDEX_VECTORS = 5  # ids, positions, slots, src, seq_lens


def attention_variant() -> str:
    """``KVSERVE_GRAPH_ATTENTION``: the captured decode attention, ``auto`` (by batch bucket:
    :data:`MATMUL_MAX_SEQS`) or one of ``attention_static.VARIANTS`` for every bucket."""
    return os.environ.get("KVSERVE_GRAPH_ATTENTION", DEFAULT_ATTENTION)


def enabled() -> bool:
    """``KVSERVE_CUDA_GRAPHS`` (default on): 0/false/no/off runs every step eagerly."""
    return os.environ.get("KVSERVE_CUDA_GRAPHS", "1").lower() not in ("0", "false", "no", "off")


def bucket(n: int, least: int = 1) -> int:
    """The smallest power of two ``>= max(n, least)``."""
    b = least
    while b < n:
        b *= 2
    return b


@dataclass
class _Entry:
    """One (S, NB) graph: its host staging, device buffers (one tensor each) and output."""

    seqs: int
    blocks: int
    host: torch.Tensor
    dev: torch.Tensor
    graph: Any = None
    hidden: torch.Tensor | None = None
    replays: int = 0

    def views(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """ids, positions, slots, src, seq_lens ``[S]`` each, tables ``[S, NB]``."""
        s = self.seqs
        *vectors, tables = t.split([s] * _INDEX_VECTORS + [s * self.blocks])
        return (*vectors, tables.view(s, self.blocks))


@dataclass
class DecodeGraphs:
    """The runner's decode graphs (module doc). ``model`` is the runner's model, on ``device``."""

    model: torch.nn.Module
    block_size: int
    sliding_window: int | None
    device: torch.device
    max_blocks: int
    capture: bool = True
    entries: dict[tuple[int, int], _Entry] = field(default_factory=dict)
    captures: int = 0
    replays: int = 0
    _pool: Any = None
    attention: str = field(default_factory=attention_variant)
    _backends: dict[str, StaticDecodeBackend] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.attention not in ("auto", *VARIANTS):
            raise ValueError(f"KVSERVE_GRAPH_ATTENTION must be auto, {' or '.join(VARIANTS)}; got {self.attention!r}")

    def variant_for(self, seqs: int) -> str:
        """The attention variant captured for a batch bucket of ``seqs``."""
        if self.attention != "auto":
            return self.attention
        return "matmul" if seqs <= MATMUL_MAX_SEQS else "sdpa"

    def eligible(self, chunks: list[ScheduledChunk], layers: list[Any]) -> bool:
        """True when this step can run as a graph: every chunk one sampled decode token with no
        attention rule of its own (a window other than the model's, sinks, scores, dropped blocks), on plain float KV tensors, within the largest buckets."""
        if not chunks or len(chunks) > MAX_SEQS or not isinstance(layers[0], (torch.Tensor, PlainLayerKV)):
            return False
        longest = 0
        for c in chunks:
            if (c.num_new_tokens != 1 or c.num_sample != 1 or c.model_drafts or c.window not in (None, self.sliding_window) or c.sinks
                    or c.score_queries or None in c.block_ids):
                return False
            longest = max(longest, -(-c.end // self.block_size))
        return bucket(longest, MIN_BLOCKS) <= self.max_blocks

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            layers: list[Any]) -> torch.Tensor:
        """The step's final hidden states ``[n, hidden]`` (before the final norm's consumers), for
        the ``n`` decodes described by the eager inputs (host tensors, one row per sequence)."""
        n = len(meta.seq_lens)
        longest = max(t.numel() for t in meta.block_tables)
        entry = self._entry(bucket(n), bucket(longest, MIN_BLOCKS))
        self._fill(entry, input_ids, positions, meta)
        if entry.hidden is None:
            self._capture(entry, layers)
        elif entry.graph is not None:
            entry.graph.replay()
        else:
            entry.hidden = self._forward(entry, layers)
        entry.replays += 1
        self.replays += 1
        assert entry.hidden is not None
        return entry.hidden[:n]

    def _entry(self, seqs: int, blocks: int) -> _Entry:
        entry = self.entries.get((seqs, blocks))
        if entry is None:
            size = seqs * (_INDEX_VECTORS + blocks)
            pin = self.device.type == "cuda"
            host = torch.zeros(size, dtype=torch.long, pin_memory=pin)
            dev = torch.zeros(size, dtype=torch.long, device=self.device)
            entry = self.entries[(seqs, blocks)] = _Entry(seqs, blocks, host, dev)
        return entry

    def _fill(self, e: _Entry, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Stage the step's rows (padding rows repeat the last real one) and copy them over."""
        n = len(meta.seq_lens)
        ids, pos, slots, src, lens, tables = e.views(e.host)
        rows = torch.arange(e.seqs).clamp_(max=n - 1)
        ids.copy_(input_ids.cpu()[rows])
        pos.copy_(positions.cpu()[rows])
        slots.copy_(meta.slot_mapping.cpu()[rows])
        src.copy_(rows)
        lens.copy_(torch.tensor(meta.seq_lens)[rows])
        tables.zero_()
        for i, t in enumerate(meta.block_tables):
            tables[i, : t.numel()] = t
        tables[n:] = tables[n - 1]
        e.dev.copy_(e.host, non_blocking=True)

    def _forward(self, e: _Entry, layers: list[Any]) -> torch.Tensor:
        """The model over the entry's device buffers: what the graph captures."""
        ids, pos, slots, src, lens, tables = e.views(e.dev)
        meta = AttentionMetadata(slots, list(range(e.seqs + 1)), [1] * e.seqs, [], self.block_size,
                                 self.sliding_window)
        variant = self.variant_for(e.seqs)
        if variant not in self._backends:
            self._backends[variant] = StaticDecodeBackend(variant)
        meta.backend = self._backends[variant]
        meta.plan = static_plan(tables, lens, src, self.block_size, self.sliding_window)
        return self.model(ids, pos, layers, meta)  # type: ignore[no-any-return]

    def _capture(self, e: _Entry, layers: list[Any]) -> None:
        """First use of ``e``: on CUDA, warm up, capture, replay; else run it eagerly."""
        if not self.capture:
            e.hidden = self._forward(e, layers)
            return
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(e, layers)  # warm-up: lazy inits off the graph; writes this step's own K/V
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self._forward(e, layers)
        graph.replay()
        e.graph, e.hidden = graph, hidden
        self.captures += 1
        log.info("captured a CUDA graph for %d sequences x %d blocks in %.0f ms", e.seqs, e.blocks,
                 1e3 * (time.perf_counter() - t0))
