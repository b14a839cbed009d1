"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

One rule serves prefill, chunked prefill, prefix hits and decode: each step hands every running
request ``min(tokens it still has to compute, budget left)`` tokens, oldest first, then admits
waiting requests while budget, ``max_num_seqs`` and free blocks allow. A long prompt therefore
takes a chunk per step while the running decodes keep their one token each.

When the pool cannot hold a running request's next tokens, the most recently admitted request is
preempted: its blocks are freed, ``num_computed_tokens`` returns to 0, and it goes back to the
front of the queue to be recomputed (its tokens so far are kept). Admission rejects requests that
could never fit, so the oldest request can always proceed: no deadlock.

What crosses to the runner is plain data (:mod:`kvserve.contract`): the scheduler remembers how
many of each request's tokens the runner has been told (``_told``), sends the rest in the next
chunk, and lists the requests the runner should forget (finished or preempted). It uses only the
KV manager's seam (``kvserve.kv.manager``), never the pool behind it.

Speculative decoding (``SchedulerConfig.speculative``): a decoding request may carry draft tokens
from :class:`~kvserve.spec.drafter.Drafter` as extra ``new_token_ids`` of its chunk, with
``num_sample = k + 1``; the slots they need are taken only from free blocks (no preemption, no
session eviction for a draft). ``update`` counts KV up to the last accepted position, tells the
runner's copy to be that long, and returns the blocks past it (``KVCacheManager.trim``): a
rejected draft's KV is rewritten or freed, never hashed into the prefix cache.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from kvserve.config import SchedulerConfig
from kvserve.contract import NewRequest, RunnerOutput, ScheduledChunk, SchedulerOutput
from kvserve.kv.manager import ComputedBlocks, KVCacheManager
from kvserve.kv.press import PressSpec
from kvserve.kv.tier_seam import Loading
from kvserve.request import Request, RequestStatus
from kvserve.spec.drafter import Drafter


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._told: dict[str, int] = {}   # request id -> tokens the runner knows
        self._forget: list[str] = []      # finished since the last step: the runner drops them
        self.loading: dict[str, tuple[Request, Loading]] = {}  # KV on its way back from a tier
        self._step_id = 0
        self.drafter = Drafter(config.speculative) if config.speculative.enabled else None

    # -- admission ---------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request, or raise ValueError if it could never fit."""
        self.validate(req.num_prompt_tokens, req.sampling_params.max_tokens, req.kv_press)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def validate(self, num_prompt_tokens: int, max_tokens: int, press: PressSpec | None = None) -> None:
        """Raise ValueError for a request that could never run. A windowed request (the model's
        window, a ``sinks`` policy) needs only the blocks its window spans at its widest step."""
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty; give at least one token")
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"max_model_len ({self.max_model_len}); shorten the prompt or lower max_tokens"
            )
        capacity = self.kv.num_blocks * self.kv.block_size
        chunk = self.config.max_num_batched_tokens if self.config.enable_chunked_prefill else total
        if self.kv.peak_blocks(press, total, chunk) > self.kv.num_blocks:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens can never fit the KV pool of {capacity} tokens "
                f"({self.kv.num_blocks} blocks); raise kv_cache_memory or lower max_tokens"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and total > budget:
            # unchunked, a request (re)computes whole in one step: after a preemption that is
            # prompt + generated tokens, so anything over the budget would wait forever
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"max_num_batched_tokens ({budget}) with chunked prefill off; enable chunked prefill, "
                f"raise max_num_batched_tokens to at least {total}, or shorten the prompt / lower max_tokens"
            )

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.kv.expire_sessions()
        self.kv.pins.expire()
        self.kv.peers.expire()
        self._step_id += 1
        out = SchedulerOutput(step_id=self._step_id, finished=self._forget)
        self._forget = []
        budget = self.config.max_num_batched_tokens
        preempted_now = False
        drafter = self.drafter if self.drafter and self.drafter.active(len(self.running)) else None
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = drafter.propose(req, budget - n) if drafter else []
            if drafts and not self.kv.allocate_slots(req, n + len(drafts), evict_sessions=False):
                drafts = []
            if drafts or self._allocate_or_preempt(req, n, out):
                if drafts:
                    out.chunks.append(self._chunk(req, n, out, drafts))
                budget -= n + len(drafts)
                i += 1
            else:
                preempted_now = True  # req itself was preempted; running shrank past i
        if not preempted_now:
            budget = self._admit(budget, out)
        for req in self.running:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
        out.block_ops = self.kv.take_block_ops()
        return out

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Allocate ``n`` slots for ``req``, preempting the newest running requests as needed.
        Returns False if ``req`` itself had to be preempted."""
        while not self.kv.allocate_slots(req, n):
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is req:
                return False
        out.chunks.append(self._chunk(req, n, out))
        return True

    def _admit(self, budget: int, out: SchedulerOutput) -> int:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if req.waiting_for_leader:
                skipped.append(req)
                continue
            computed = self.kv.get_computed_blocks(req)
            if not req.tiers_checked:
                req.tiers_checked = True
                loading = self.kv.begin_loading(req, computed)
                if loading is not None:  # admitted next step, once its KV is back in the pool
                    req.status = RequestStatus.LOADING
                    self.loading[req.request_id] = (req, loading)
                    continue
            n = min(req.num_tokens - computed.num_tokens, budget)
            if not self.config.enable_chunked_prefill and n < req.num_tokens - computed.num_tokens:
                self.waiting.appendleft(req)
                break
            if not self.kv.allocate_slots(req, n, computed):
                self.waiting.appendleft(req)
                break
            req.num_computed_tokens = computed.num_tokens
            if req.kv_miss_tokens is None:  # the ledger, once: why the rest is computed
                req.kv_miss_tokens = self.kv.miss_reasons(req, computed)
            if req.num_cached_tokens == 0 and computed.num_tokens:  # the ledger: where the hit came from
                below = sum(req.kv_hit_tokens.values())
                req.kv_hit_tokens["pool"] = max(0, computed.num_tokens - below)
            req.num_cached_tokens = max(req.num_cached_tokens, computed.num_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(self._chunk(req, n, out))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _chunk(self, req: Request, n: int, out: SchedulerOutput, drafts: list[int] | None = None) -> ScheduledChunk:
        """The plain record of ``n`` tokens of ``req`` from ``num_computed_tokens`` (plus its
        ``drafts``, to verify); a request the runner does not know yet is introduced with all its
        tokens and its sampling settings."""
        told = self._told.get(req.request_id)
        if told is None:
            out.new_requests.append(NewRequest(req.request_id, req.num_prompt_tokens, req.sampling_params,
                                               req.seed, req.kv_cache_dtype, req.eos_token_ids))
            told = 0
        new = req.token_ids_from(told) + (drafts or [])
        self._told[req.request_id] = told + len(new)
        start = req.num_computed_tokens
        k = len(drafts or ())
        window, sinks = self.kv.window_of(req)
        model_drafts = k if self.drafter is not None and self.drafter.config.by_model else 0
        return ScheduledChunk(req.request_id, start, n + k, new, list(self.kv.block_table(req.request_id)),
                              1 + k if start + n == req.num_tokens else 0, window=window, sinks=sinks,
                              score_queries=self.kv.score_queries(req, start, n), model_drafts=model_drafts)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        if self._told.pop(req.request_id, None) is not None:
            out.preempted.append(req.request_id)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- after the model ran -----------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Advance computed counts, append the sampled tokens (several when drafts were accepted),
        stopping at the first stop condition, and fail the requests the runner could not serve.
        Returns the requests that received a token or failed this step (finished ones included)."""
        changed: list[Request] = []
        now = self.clock()
        self._finish_loading(result)
        for chunk in out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status.finished:  # aborted while the step ran
                continue
            error = result.failed.get(chunk.request_id)
            if error is not None:
                req.status, req.error = RequestStatus.FINISHED_ERROR, error
                changed.append(req)
                continue
            sampled = result.sampled.get(chunk.request_id)
            tokens = sampled.token_ids if sampled is not None and chunk.sample else []
            # KV is valid up to the last accepted position: a verify chunk (num_sample = k + 1)
            # whose j drafts were accepted returns j + 1 tokens; rejected drafts' slots are rewritten.
            req.num_computed_tokens = chunk.end - chunk.num_sample + min(len(tokens), chunk.num_sample)
            if chunk.num_sample > 1:
                self._verified(req, chunk, len(tokens))
            for token in tokens:
                req.append_token(token)
                self._check_stop(req, token)
                if req.status.finished:
                    break
            # a stop inside the accepted tokens: KV past the last kept token is not the request's
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1 if tokens else req.num_tokens)
            if chunk.num_sample > 1:
                self.kv.trim(req)
            self.kv.cache_blocks(req)
            self.kv.forget(req)  # after caching: a block outside the window stays findable
            if result.block_scores:
                self.kv.apply_scores(req, result.block_scores.get(chunk.request_id))
            if not tokens:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            changed.append(req)
        for req in changed:
            if req.status.finished:
                self._finish(req, now)
        return changed

    def _verified(self, req: Request, chunk: ScheduledChunk, num_tokens: int) -> None:
        """A verify chunk came back with ``num_tokens`` tokens (accepted drafts + one): the
        runner's copy now ends at the last accepted draft."""
        assert self.drafter is not None
        self.drafter.verified(req, chunk.num_sample - 1, max(0, num_tokens - 1))
        if req.request_id in self._told:
            self._told[req.request_id] = req.num_computed_tokens

    def _finish_loading(self, result: RunnerOutput) -> None:
        """Loads that finished (this step or while earlier steps ran): a request whose loads are
        all in goes back to the front of the queue, to be admitted on what is now in the pool."""
        self.kv.tiers.apply(result.tier_events)
        if not result.loaded:
            return
        done = {id(loading) for loading in self.kv.tiers.receive(result.loaded)}
        for rid, (req, loading) in list(self.loading.items()):
            if id(loading) not in done:
                continue
            del self.loading[rid]
            req.kv_hit_tokens.update(loading.hit_tokens)
            req.kv_load_seconds += loading.load_seconds
            req.kv_failed_loads = loading.failed
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    def _check_stop(self, req: Request, token: int) -> None:
        params = req.sampling_params
        if not params.ignore_eos and token in req.eos_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
        elif token in params.stop_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: str | None = None) -> None:
        """End a request from outside (abort, stop string); its blocks come back at once."""
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            return
        req.status, req.stop_reason = status, stop_reason
        self._finish(req, self.clock())

    def _finish(self, req: Request, now: float) -> None:
        # a loading request's held blocks stay with the tier seam until its reads report
        self.loading.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
        if self.drafter is not None:
            self.drafter.forget(req)
        req.finished_time = now
        self.requests.pop(req.request_id, None)
        if self._told.pop(req.request_id, None) is not None:
            self._forget.append(req.request_id)

    # -- state -------------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.kv.tiers.loads_in_flight)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


__all__ = ["ComputedBlocks", "Scheduler"]
