"""What one scheduling step decided, handed from the scheduler to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``start .. start + num_new_tokens - 1`` of ``request`` to compute this step.
    ``sample`` is True when the chunk reaches the request's last known token, so the step
    produces its next token (a mid-prompt chunk of a chunked prefill samples nothing)."""

    request: Request
    start: int
    num_new_tokens: int
    block_table: tuple[int, ...]
    sample: bool

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start:self.end]

    @classmethod
    def of(cls, request: Request, num_new_tokens: int, block_table: list[int]) -> ScheduledChunk:
        start = request.num_computed_tokens
        return cls(request, start, num_new_tokens, tuple(block_table),
                   start + num_new_tokens == request.num_tokens)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks
