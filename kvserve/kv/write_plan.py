"""A step's write plan: where each new token's K/V goes, per codec pair; the same for every layer.

Built once per step by :meth:`kvserve.kv.storage.KVStorage.begin_step` from python lists, turned
into index tensors once, then followed by every layer's ``write``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Writes:
    """Per codec pair: token ``rows`` of the step's batch go to (``blocks``, ``offsets``)."""

    rows: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class TokenWrite:
    rows: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor
    all_rows: bool  # rows == 0..T-1: index nothing


@dataclass(frozen=True)
class Finalize:
    """Blocks whose int4 key groups are encoded this step, from batch rows or from shadow slots."""

    blocks: torch.Tensor
    first_rows: torch.Tensor | None  # direct: rows first_rows + 0..bs-1 of the batch
    slots: torch.Tensor | None       # else: from these shadow slots


@dataclass(frozen=True)
class WritePlan:
    """Everything a layer needs to write this step's tokens."""

    writes: dict[int, TokenWrite]
    shadow_rows: torch.Tensor | None
    shadow_slots: torch.Tensor | None
    shadow_offsets: torch.Tensor | None
    finalize: list[tuple[int, Finalize]]


@dataclass
class PlanBuilder:
    """Python lists collected while walking a step's chunks."""

    writes: dict[int, Writes] = field(default_factory=dict)
    sh_rows: list[int] = field(default_factory=list)
    sh_slots: list[int] = field(default_factory=list)
    sh_offs: list[int] = field(default_factory=list)
    direct: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    from_shadow: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)

    def build(self, device: torch.device) -> WritePlan:
        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        total = sum(len(w.rows) for w in self.writes.values())
        token_writes = {}
        for pid, w in self.writes.items():  # one tensor per pair, three views of it
            rows, blocks, offsets = t(w.rows + w.blocks + w.offsets).split(len(w.rows))
            token_writes[pid] = TokenWrite(rows, blocks, offsets, w.rows == list(range(total)))
        finalize = [(pid, Finalize(t(b), t(r), None)) for pid, (b, r) in self.direct.items()]
        finalize += [(pid, Finalize(t(b), None, t(s))) for pid, (b, s) in self.from_shadow.items()]
        if self.sh_rows:
            return WritePlan(token_writes, t(self.sh_rows), t(self.sh_slots), t(self.sh_offs), finalize)
        return WritePlan(token_writes, None, None, None, finalize)
