"""A torch-free stand-in for the model runner that still exercises block tables for real.

It speaks the plain-data contract (:mod:`kvserve.contract`): it keeps its own copy of each
request's tokens, built only from the chunks' ``new_token_ids``, and a fake KV store (slot ->
token id). Each chunk writes its tokens at the slots its block ids give; a sampling chunk then
reads the whole context back *through the block ids* and derives the next token from what it
read. Wrong block tables, a shared block overwritten, a stale prefix hit or a wrong ``new_token_ids``
change the tokens, so comparing against a run alone catches them. A verify chunk
(``num_sample = k + 1``) is checked the way the model runner checks it, position by position.
A chunk with ``model_drafts`` placeholders has them filled first by ``draft_rule`` (the draft
model's stand-in), greedily over the request's real tokens, as the runner's draft model does.
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.contract import CopyBlock, RunnerOutput, SampledTokens, ScheduledChunk, SchedulerOutput


def next_token(context: list[int]) -> int:
    h = 7
    for t in context:
        h = (h * 31 + t) % 1_000_003
    return 10 + h % 50


def slots_for(block_ids: list[int | None], positions: range | list[int], block_size: int) -> list[int]:
    """Slots of ``positions``; a position in a dropped block (``None``) must never be asked for."""
    out = []
    for p in positions:
        b = block_ids[p // block_size]
        assert b is not None, f"position {p} read or written through a dropped block"
        out.append(b * block_size + p % block_size)
    return out


def visible(end: int, window: int | None, sinks: int) -> list[int]:
    """Positions the query at ``end - 1`` reads: all, or the window and the sinks."""
    q = end - 1
    return [k for k in range(end) if window is None or k > q - window or k < sinks]


class FakeRunner:
    def __init__(self, block_size: int, rule: Callable[[list[int]], int] = next_token,
                 draft_rule: Callable[[list[int]], int] | None = None) -> None:
        self.block_size = block_size
        self.rule = rule  # the "model": next token of a context
        self.draft_rule = draft_rule  # the draft model, for chunks with model_drafts
        self.verified: list[tuple[int, int]] = []  # per sampled chunk: (drafts, accepted)
        self.store: dict[int, int] = {}
        self.tokens: dict[str, list[int]] = {}  # what the runner has been told, per request
        self.steps = 0
        self.batched_tokens: list[int] = []

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        self.steps += 1
        self.batched_tokens.append(plan.num_batched_tokens)
        for rid in [*plan.finished, *plan.preempted]:
            self.tokens.pop(rid, None)
        for new in plan.new_requests:
            assert new.request_id not in self.tokens, f"{new.request_id} introduced twice"
            self.tokens[new.request_id] = []
        bs = self.block_size
        for op in plan.block_ops:
            assert isinstance(op, CopyBlock), f"no tier configured in the fake runner: {op}"
            for off in range(bs):
                if op.src * bs + off in self.store:
                    self.store[op.dst * bs + off] = self.store[op.src * bs + off]
        for c in plan.chunks:
            known = self.tokens[c.request_id]
            known.extend(c.new_token_ids)
            assert len(known) >= c.end, f"{c.request_id}: told {len(known)} tokens, asked to compute to {c.end}"
            if c.model_drafts:
                assert self.draft_rule is not None and 0 < c.model_drafts < c.num_sample
                assert known[c.end - c.model_drafts:c.end] == [-1] * c.model_drafts, "placeholders expected"
                for p in range(c.end - c.model_drafts, c.end):
                    known[p] = self.draft_rule(known[:p])
            for slot, tok in zip(slots_for(c.block_ids, range(c.start, c.end), bs), known[c.start:c.end]):
                self.store[slot] = tok
        out = RunnerOutput(step_id=plan.step_id)
        for c in plan.chunks:
            if c.sample:
                if c.num_sample > 1:  # a verify chunk (never windowed here): every position's context
                    context = [self.store[s] for s in slots_for(c.block_ids, range(c.end), bs)]
                    out.sampled[c.request_id] = SampledTokens(self._verify(c, context))
                else:
                    context = [self.store[s] for s in slots_for(c.block_ids, visible(c.end, c.window, c.sinks), bs)]
                    out.sampled[c.request_id] = SampledTokens([self.rule(context)])
        return out

    def _verify(self, c: ScheduledChunk, context: list[int]) -> list[int]:
        """The token after each of the chunk's last ``num_sample`` positions, cut after the first
        that disagrees with the draft at the next position (the real runner's rule); the
        rejected drafts leave this runner's copy."""
        first = c.end - c.num_sample
        tokens: list[int] = []
        for j in range(c.num_sample):
            token = self.rule(context[:first + j + 1])
            tokens.append(token)
            if first + j + 1 < c.end and context[first + j + 1] != token:
                break
        del self.tokens[c.request_id][first + len(tokens):]
        self.verified.append((c.num_sample - 1, len(tokens) - 1))
        return tokens


def run_checked(sched, runner: FakeRunner, after_step=lambda plan: None, max_steps: int = 10_000) -> None:  # type: ignore[no-untyped-def]
    """Step until nothing is left, checking the KV books before and after each update; fails
    after ``max_steps`` (a livelock) instead of spinning."""
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return
        plan = sched.schedule()
        sched.kv.check()
        sched.update(plan, runner.execute(plan))
        sched.kv.check()
        after_step(plan)
    raise AssertionError("scheduler did not finish: livelock")
