"""Turn the logits of the sampling positions into token ids.

Greedy rows take the argmax. Other rows apply temperature, then top-k, then top-p, then draw
from the softmax with the request's own ``torch.Generator``: a request seeded with ``seed``
draws the same tokens whatever else shares its batch, and a request preempted and recomputed
continues its generator where it stopped, because it samples exactly once per generated token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits ``[V]`` outside the top-k and the top-p nucleus with -inf."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


class Sampler:
    """Holds one generator per live request id; ``release`` drops it when the request ends."""

    def __init__(self, seed: int = 0) -> None:
        self._seed_source = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, req: Request) -> torch.Generator:
        g = self._generators.get(req.request_id)
        if g is None:
            seed = req.sampling_params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            else:
                seed = seed + 1_000_003 * req.sample_index  # distinct samples for n > 1
            g = torch.Generator().manual_seed(seed)
            self._generators[req.request_id] = g
        return g

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampleResult]:
        """logits: ``[S, V]`` float32, one row per request in ``requests``."""
        logits = logits.float().cpu()
        greedy_ids = torch.argmax(logits, dim=-1).tolist()
        results: list[SampleResult] = []
        for row, req, greedy_id in zip(logits, requests, greedy_ids):
            params = req.sampling_params
            if params.greedy:
                token = greedy_id
                scores = row
            else:
                scores = apply_top_k_top_p(row / params.temperature, params.top_k, params.top_p)
                probs = torch.softmax(scores, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=self._generator(req)))
            results.append(self._with_logprobs(token, scores, params))
        return results

    @staticmethod
    def _with_logprobs(token: int, scores: torch.Tensor, params: SamplingParams) -> SampleResult:
        if params.logprobs is None:
            return SampleResult(token)
        logprobs = torch.log_softmax(scores, dim=-1)
        top: dict[int, float] = {}
        if params.logprobs > 0:
            vals, idx = torch.topk(logprobs, params.logprobs)
            top = dict(zip(idx.tolist(), vals.tolist()))
        return SampleResult(token, float(logprobs[token]), top)
