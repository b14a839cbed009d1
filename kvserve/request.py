"""Request state as the scheduler sees it, and the outputs the engine hands back.

A request never has a prefill/decode mode flag. It knows two numbers::

    all_token_ids:   | prompt ............ | generated ... |
                     0            num_computed_tokens     num_tokens
                     |<--- KV in cache --->|<- to compute ->|

Each step the scheduler hands it some of the tokens still to compute (a prefill chunk, or the
one token of a decode). When ``num_computed_tokens`` reaches ``num_tokens`` the runner samples
the next token. Preemption resets ``num_computed_tokens`` to 0 (recompute).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.kv.press.spec import PressSpec
from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # its prefix's KV is being brought back from a tier
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # this request's preparation, forward or sampling raised

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISH_OF_STATUS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass
class Request:
    """One sequence being generated. ``n > 1`` requests are fanned out into ``n`` of these
    sharing ``group_id``; every sibling but the first waits for the first to finish its
    prefill, so they hit its prompt blocks in the prefix cache."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    group_id: str | None = None
    sample_index: int = 0
    leader: Request | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    kv_cache_dtype: str | None = None  # per-request KV codec override (canonical name); None = the engine's
    kv_press: PressSpec | None = None  # an opt-in KV eviction policy (kvserve.kv.press); None = keep all KV
    seed: int = 0  # this sample's concrete sampling seed (drawn by the engine when none was given)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None  # why the request failed (status FINISHED_ERROR)
    # the KV ledger: prompt tokens found per place ("pool", "host", "disk", "remote"), load time
    kv_hit_tokens: dict[str, int] = field(default_factory=dict)
    kv_load_seconds: float = 0.0
    kv_miss_tokens: dict[str, int] | None = None  # why the rest was recomputed (kvserve.kv.miss_ledger)
    kv_failed_loads: frozenset[bytes] = frozenset()  # block hashes a tier held but failed to load
    tiers_checked: bool = False  # a request consults the tiers once (what fails to load is recomputed)
    # the prompt-caching API (kvserve.kv.prefix_pins): (pin key or None, prompt tokens, TTL s) to
    # pin when the request finishes; tokens newly written to a pin (not read from the cache)
    cache_pins: tuple[tuple[str | None, int, float], ...] = ()
    cache_write_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens this request may generate: its KV high-water mark."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_OF_STATUS.get(self.status)

    @property
    def waiting_for_leader(self) -> bool:
        """A sibling sample waits until its leader's prompt is in the cache (or the leader ended)."""
        lead = self.leader
        return (lead is not None and not lead.status.finished
                and lead.num_computed_tokens < lead.num_prompt_tokens)

    def token_ids_from(self, i: int) -> list[int]:
        """``all_token_ids[i:]`` without building the whole list (a decode step asks for one)."""
        p = len(self.prompt_token_ids)
        if i >= p:
            return self.output_token_ids[i - p:]
        return self.prompt_token_ids[i:] + self.output_token_ids

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def keep_output(self, n: int) -> None:
        """Keep only the first ``n`` output tokens (a stop string completed inside a run of
        accepted drafts); KV counts as computed at most up to the last kept token's predecessor."""
        del self.output_token_ids[n:]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens - 1)


@dataclass
class CompletionOutput:
    """One sample of a request (``index`` in ``0..n-1``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns and the engine streams: the prompt, and ``n`` samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when a sample failed (its finish_reason is "error")
    kv_hit_tokens: dict[str, int] = field(default_factory=dict)  # prompt tokens reused, per tier ("pool", "disk" …)
    kv_load_seconds: float = 0.0  # time spent loading KV from the tiers
    cache_write_tokens: int = 0  # prompt tokens this request wrote into a pinned prefix (prompt caching)
    kv_miss_tokens: dict[str, int] = field(default_factory=dict)  # prompt tokens recomputed, by reason
