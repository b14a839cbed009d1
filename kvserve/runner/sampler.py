"""Turn the logits of the sampling positions into token ids.

A row first goes through the request's logits processors (penalties, logit bias, masks, min_tokens:
:mod:`kvserve.runner.logits_processors`) and its grammar (``response_format``:
:mod:`kvserve.runner.structured`), when it has any. Greedy rows then take the argmax
(:func:`kvserve.native.argmax.argmax_rows`: torch.argmax's indices, natively). On a GPU, a step
whose rows are all plain greedy (no processor, grammar or logprobs) takes the argmax there and
copies only the ids to the host; any other row sends the step's logits to the host path. Other rows apply
temperature, then min-p, then top-k, then top-p, then draw from the softmax with a generator
seeded by ``(request seed, output index)``: a draw is a pure function of the request and the
position, so a request draws the same tokens whatever else shares its batch, after a
preemption, in another process or on another replica.
"""

from __future__ import annotations

import torch

from kvserve.contract import TokenLogprobs
from kvserve.native.argmax import argmax_rows
from kvserve.runner.inputs import SampleRow
from kvserve.runner.logits_processors import apply_logits_processors, apply_min_p, needs_processing
from kvserve.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, output_index: int) -> int:
    """splitmix64 of ``(seed, output_index)``: independent, well-mixed seeds per position."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits: torch's manual_seed takes it as a non-negative int64


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
    """Stateless: everything a draw depends on comes in the row."""

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[tuple[int, TokenLogprobs | None] | Exception]:
        """logits: ``[S, V]``, one row per entry of ``rows``. A row whose sampling raises yields
        the exception instead of a token (that request fails; the others are unaffected)."""
        if logits.device.type != "cpu" and all(_plain_greedy(r) for r in rows):
            return [(t, None) for t in logits.argmax(-1).tolist()]  # on the device: ids cross, not logits
        logits = logits.float().cpu()
        greedy_ids = argmax_rows(logits).tolist()
        out: list[tuple[int, TokenLogprobs | None] | Exception] = []
        for scores, row, greedy_id in zip(logits, rows, greedy_ids):
            try:
                out.append(self._one(scores, row, greedy_id))
            except Exception as e:  # noqa: BLE001 - attributed to this row's request
                out.append(e)
        return out

    def _one(self, row_logits: torch.Tensor, row: SampleRow, greedy_id: int) -> tuple[int, TokenLogprobs | None]:
        state = row.state
        params = state.sampling
        matcher = state.extra.get("matcher")
        if needs_processing(params) or matcher is not None:
            p = state.num_prompt_tokens
            row_logits = apply_logits_processors(row_logits, params, state.token_ids[:p],
                                                 state.token_ids[p:p + row.output_index], state.eos_token_ids)
            if matcher is not None:
                row_logits = matcher.apply(row_logits)  # type: ignore[attr-defined]
            greedy_id = int(argmax_rows(row_logits[None])[0])
        if params.greedy:
            token, scores = greedy_id, row_logits
        else:
            scores = apply_min_p(row_logits / params.temperature, params.min_p)
            scores = apply_top_k_top_p(scores, params.top_k, params.top_p)
            probs = torch.softmax(scores, dim=-1)
            g = torch.Generator().manual_seed(draw_seed(state.seed, row.output_index))
            token = int(torch.multinomial(probs, 1, generator=g))
        if matcher is not None:
            matcher.accept(token)  # type: ignore[attr-defined]
        return token, _logprobs(token, scores, params)


def _plain_greedy(row: SampleRow) -> bool:
    """A greedy row with no processor, grammar or logprobs: its token is the argmax alone."""
    p = row.state.sampling
    return p.greedy and p.logprobs is None and not needs_processing(p) and "matcher" not in row.state.extra


def _logprobs(token: int, scores: torch.Tensor, params: SamplingParams) -> TokenLogprobs | None:
    if params.logprobs is None:
        return None
    logprobs = torch.log_softmax(scores, dim=-1)
    top: dict[int, float] = {}
    if params.logprobs > 0:
        vals, idx = torch.topk(logprobs, params.logprobs)
        top = dict(zip(idx.tolist(), vals.tolist()))
    return TokenLogprobs(float(logprobs[token]), top)
