"""The runner's own per-request state, kept across steps and keyed by request id.

Created on a request's first sight (:class:`~kvserve.contract.NewRequest`, or a bare chunk for
teacher-forced scoring), extended by each chunk's ``new_token_ids``, dropped when the scheduler
lists the id as finished or preempted. Invariant after :meth:`RunnerState.apply`: every scheduled
chunk's request knows at least ``chunk.end`` tokens. After a verify chunk (``num_sample = k + 1``)
the runner cuts its copy after the last accepted draft (``ModelRunner._run``), the length the
scheduler then counts as told.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.contract import NewRequest, SchedulerOutput
from kvserve.sampling_params import SamplingParams

_SCORING = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class RequestState:
    request_id: str
    num_prompt_tokens: int
    sampling: SamplingParams
    seed: int
    kv_codec: str | None
    eos_token_ids: tuple[int, ...]
    token_ids: list[int] = field(default_factory=list)
    extra: dict[str, object] = field(default_factory=dict)  # per-request helpers (e.g. a grammar matcher)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @classmethod
    def of(cls, new: NewRequest) -> RequestState:
        return cls(new.request_id, new.num_prompt_tokens, new.sampling, new.seed, new.kv_codec,
                   tuple(new.eos_token_ids))


class RunnerState:
    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}

    def apply(self, out: SchedulerOutput) -> None:
        """Forget, then introduce, then extend: the order a step record is read in."""
        for rid in (*out.finished, *out.preempted):
            self.requests.pop(rid, None)
        for new in out.new_requests:
            self.requests[new.request_id] = RequestState.of(new)
        for c in out.chunks:
            state = self.requests.get(c.request_id)
            if state is None:  # a chunk without a NewRequest: scoring only (no sampling)
                state = self.requests[c.request_id] = RequestState(c.request_id, 0, _SCORING, 0, None, ())
            state.token_ids.extend(c.new_token_ids)
            if len(state.token_ids) < c.end:
                raise ValueError(f"request {c.request_id!r}: chunk ends at {c.end} but the runner knows "
                                 f"{len(state.token_ids)} tokens")

    def __len__(self) -> int:
        return len(self.requests)
