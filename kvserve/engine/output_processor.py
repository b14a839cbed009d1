"""From token ids to ``RequestOutput``: detokenize, apply stop strings, group ``n`` samples.

A group (one user request) lives here from ``add_group`` until the output that reports it
finished has been emitted; then it is forgotten.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.contract import RunnerOutput
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.request import CompletionOutput, Request, RequestMetrics, RequestOutput


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: list[IncrementalDetokenizer]
    logprobs: list[list[dict[int, float]]] = field(default_factory=list)
    seen: list[int] = field(default_factory=list)  # per sample: output tokens already detokenized


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}
        self._dirty: dict[str, None] = {}

    def add_group(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                  children: list[Request]) -> None:
        detoks = [IncrementalDetokenizer(self.tokenizer, c.sampling_params) for c in children]
        self.groups[request_id] = _Group(request_id, prompt, prompt_token_ids, children, detoks,
                                         [[] for _ in children], [0 for _ in children])

    def children(self, request_id: str) -> list[Request]:
        group = self.groups.get(request_id)
        if group is not None:
            self._dirty[request_id] = None  # report the abort at the next step
        return group.children if group else []

    def process(self, changed: list[Request], result: RunnerOutput,
                stop: Callable[[Request, str], None]) -> list[RequestOutput]:
        for req in changed:
            group = self.groups[req.group_id or req.request_id]
            i = req.sample_index
            detok = group.detoks[i]
            start = group.seen[i]
            new = req.output_token_ids[start:]  # several tokens when drafts were accepted
            detok.add(new)
            if detok.stopped_by is not None and detok.num_consumed < len(req.output_token_ids):
                req.keep_output(detok.num_consumed)  # the stop string ended inside accepted drafts
                new = new[:detok.num_consumed - start]
            group.seen[i] = start + len(new)
            sampled = result.sampled.get(req.request_id)
            if sampled is not None and sampled.logprobs is not None:
                for token, lp in zip(new, sampled.logprobs):
                    group.logprobs[i].append({token: lp.logprob, **lp.top})
            if detok.stopped_by is not None and not req.status.finished:
                stop(req, detok.stopped_by)
            self._dirty[group.request_id] = None
        return self.flush()

    def flush(self) -> list[RequestOutput]:
        """Outputs for every group that changed since the last call."""
        outs = [self._output(self.groups[gid]) for gid in self._dirty if gid in self.groups]
        self._dirty.clear()
        for out in outs:
            if out.finished:
                del self.groups[out.request_id]
        return outs

    def _output(self, g: _Group) -> RequestOutput:
        completions = []
        for req, detok, lps in zip(g.children, g.detoks, g.logprobs):
            reason = req.finish_reason
            completions.append(CompletionOutput(
                index=req.sample_index, text=detok.text, token_ids=list(req.output_token_ids),
                finish_reason=reason.value if reason else None, stop_reason=req.stop_reason,
                logprobs=lps if req.sampling_params.logprobs is not None else None,
            ))
        lead = g.children[0]
        metrics = RequestMetrics(lead.arrival_time, lead.first_scheduled_time, lead.first_token_time,
                                 max((c.finished_time or 0.0) for c in g.children) or None,
                                 sum(c.num_preemptions for c in g.children))
        errors = [c.error for c in g.children if c.error]
        return RequestOutput(
            request_id=g.request_id, prompt=g.prompt, prompt_token_ids=g.prompt_token_ids,
            outputs=completions, finished=all(c.status.finished for c in g.children),
            num_cached_tokens=lead.num_cached_tokens, metrics=metrics, error=errors[0] if errors else None,
            kv_hit_tokens=dict(lead.kv_hit_tokens), kv_load_seconds=lead.kv_load_seconds,
            cache_write_tokens=lead.cache_write_tokens,
            kv_miss_tokens=dict(lead.kv_miss_tokens or {}),
        )
