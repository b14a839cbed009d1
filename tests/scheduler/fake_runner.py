"""A torch-free stand-in for the model runner that still exercises block tables for real.

It keeps a fake KV store (slot -> token id). Each chunk writes its tokens at the slots its block
table gives; a sampling chunk then reads the whole context back *through the block table* and
derives the next token from what it read. Wrong block tables, a shared block overwritten, or a
stale prefix hit change the tokens, so comparing against a run alone catches them.
"""

from __future__ import annotations

from kvserve.runner.inputs import slots_for
from kvserve.scheduler.output import SchedulerOutput


def next_token(context: list[int]) -> int:
    h = 7
    for t in context:
        h = (h * 31 + t) % 1_000_003
    return 10 + h % 50


class FakeRunner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.store: dict[int, int] = {}
        self.steps = 0
        self.batched_tokens: list[int] = []

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        self.steps += 1
        self.batched_tokens.append(plan.num_batched_tokens)
        out: dict[str, int] = {}
        for src, dst in plan.block_copies:
            for off in range(self.block_size):
                if src * self.block_size + off in self.store:
                    self.store[dst * self.block_size + off] = self.store[src * self.block_size + off]
        for c in plan.chunks:
            for slot, tok in zip(slots_for(c.block_table, c.start, c.end, self.block_size), c.token_ids):
                self.store[slot] = tok
        for c in plan.chunks:
            if c.sample:
                context = [self.store[s] for s in slots_for(c.block_table, 0, c.end, self.block_size)]
                out[c.request.request_id] = next_token(context)
        return out
