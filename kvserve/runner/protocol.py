"""What the engine needs of a runner, wherever it runs (this process, a child, a worker group)."""

from __future__ import annotations

from typing import Protocol

import torch

from kvserve.contract import RunnerOutput, SchedulerOutput


class Runner(Protocol):
    @property
    def kv_bytes(self) -> int:
        """Bytes the runner's KV storage holds (equals ``KVCapacity.allocated_bytes``)."""
        ...

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step record: block operations, one forward, sampling."""
        ...

    def score(self, out: SchedulerOutput) -> torch.Tensor:
        """Teacher-forced logits ``[T, vocab]`` of every scheduled token."""
        ...

    def tier_snapshot(self) -> dict[str, list[tuple[bytes, int]]]:
        """What each local KV tier holds (at start-up: the disk tier's rebuilt index)."""
        ...

    def shutdown(self) -> None: ...
