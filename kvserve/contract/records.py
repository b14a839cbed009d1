"""The step records: what the scheduler tells the runner, and what the runner answers.

::

    SchedulerOutput                                   RunnerOutput
      new_requests  [NewRequest]  first sight only      sampled  {request id: SampledTokens}
      chunks        [ScheduledChunk]                    failed   {request id: error message}
      block_ops     [BlockOp]     run before forward    block_scores {request id: [score/block]}
      finished      [request id]  runner forgets them
      preempted     [request id]  (also forgotten)

The runner keeps its own per-request state keyed by request id (the token ids it has been told,
the sampling settings, a structured-output matcher): created on first sight, extended by every
chunk's ``new_token_ids``, dropped when the id appears in ``finished`` or ``preempted``. A
preempted request comes back as a new request with all its tokens.

Sampling is a pure function of ``(seed, output index)``, so a request sampled after preemption,
in another process or on another replica draws exactly what it would have drawn.
"""

from __future__ import annotations

import msgspec

from kvserve.contract.block_ops import BlockOp
from kvserve.sampling_params import SamplingParams


class NewRequest(msgspec.Struct, frozen=True):
    """What the runner needs once per request: how to sample it and which codec its KV uses."""

    request_id: str
    num_prompt_tokens: int
    sampling: SamplingParams
    seed: int  # this sample's concrete seed (the engine draws one when the request gave none)
    kv_codec: str | None = None  # None: the pool's own codec
    eos_token_ids: tuple[int, ...] = ()


class ScheduledChunk(msgspec.Struct, frozen=True):
    """Positions ``start .. start + num_new_tokens - 1`` of a request to compute this step.

    ``new_token_ids`` are tokens the runner has not been told yet, appended to its copy of the
    request's tokens before the step (all tokens so far when the runner first sees the request;
    the last sampled token for a decode; nothing for the next chunk of a known prompt). After
    appending, the runner knows at least ``start + num_new_tokens`` tokens.

    ``num_sample`` is how many of the chunk's last positions produce a next token: 0 for a
    mid-prompt chunk, 1 when the chunk reaches the last known token, ``k + 1`` when it verifies
    ``k`` draft tokens.

    ``block_ids`` is the request's block table; a ``None`` entry is a block the request dropped
    (outside its window, or evicted by a policy): never written, never read. ``window`` and
    ``sinks``: the request's attention reads keys ``k <= q`` with ``k > q - window`` or
    ``k < sinks`` (``window`` None: every key). ``score_queries``: report, per block, the attention
    the chunk's last ``score_queries`` queries pay it (``RunnerOutput.block_scores``; 0: none).
    ``model_drafts``: the last that many ``new_token_ids`` are placeholders (speculative method
    ``"draft"``) that the runner's draft model replaces with its proposals before the forward;
    always ``<= num_sample - 1``."""

    request_id: str
    start: int
    num_new_tokens: int
    new_token_ids: list[int]
    block_ids: list[int | None]
    num_sample: int = 0
    window: int | None = None
    sinks: int = 0
    score_queries: int = 0
    model_drafts: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def sample(self) -> bool:
        return self.num_sample > 0


class SchedulerOutput(msgspec.Struct):
    """One step's plan. Plain data only: it round-trips through pickle and msgspec."""

    step_id: int = 0
    new_requests: list[NewRequest] = msgspec.field(default_factory=list)
    chunks: list[ScheduledChunk] = msgspec.field(default_factory=list)
    block_ops: list[BlockOp] = msgspec.field(default_factory=list)
    finished: list[str] = msgspec.field(default_factory=list)
    preempted: list[str] = msgspec.field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks


class TokenLogprobs(msgspec.Struct, frozen=True):
    """The sampled token's log-probability and the top alternatives (token id → logprob)."""

    logprob: float
    top: dict[int, float] = msgspec.field(default_factory=dict)


class SampledTokens(msgspec.Struct, frozen=True):
    """Tokens sampled for one request this step, in order (several when drafts were accepted)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None


class TierEvent(msgspec.Struct, frozen=True):
    """What a KV tier did: ``"stored"`` / ``"removed"`` a block object (``size`` bytes),
    ``"corrupt"`` (an object failed its checksum and was deleted), ``"down"`` / ``"up"``."""

    kind: str
    tier: str
    key: bytes = b""
    size: int = 0


class LoadResult(msgspec.Struct, frozen=True):
    """What a ``LoadBlock`` found: the tier the block came from, or None (not found, or corrupt
    in every tier): that block is recomputed."""

    key: bytes
    block_id: int
    tier: str | None
    seconds: float = 0.0


class RunnerOutput(msgspec.Struct):
    """What a step produced. ``failed`` names requests whose preparation, forward or sampling
    raised; they produced nothing, the others ran normally. ``tier_events`` and ``loaded`` report
    what the block operations did to and found in the KV tiers."""

    step_id: int = 0
    sampled: dict[str, SampledTokens] = msgspec.field(default_factory=dict)
    failed: dict[str, str] = msgspec.field(default_factory=dict)
    block_scores: dict[str, list[float]] | None = None
    tier_events: list[TierEvent] = msgspec.field(default_factory=list)
    loaded: list[LoadResult] = msgspec.field(default_factory=list)
    received: dict[str, int] = msgspec.field(default_factory=dict)  # peer → leading blocks written
