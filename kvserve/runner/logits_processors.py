"""Logits processors as pure functions, with vLLM's semantics.

The sampler calls, per row of logits ``[V]`` (float32), in vLLM v1's order::

    logits = apply_logits_processors(logits, params, prompt_ids, output_ids, eos_ids)
    if not params.greedy:
        logits = logits / temperature
        logits = apply_min_p(logits, params.min_p)      # next to top-k / top-p
        logits = apply_top_k_top_p(logits, top_k, top_p)

``apply_logits_processors`` applies, in order:

1. ``allowed_token_ids``: every other token is masked (-inf);
2. ``bad_words_token_ids``: a one-token word is masked always; a longer one has its last token
   masked when the output so far ends with the rest of the word;
3. ``min_tokens``: while fewer than ``min_tokens`` tokens were generated, EOS ids and
   ``stop_token_ids`` are masked;
4. ``logit_bias``: added to the logits (ids outside the vocabulary are ignored);
5. ``repetition_penalty`` over the tokens of prompt and output: a positive logit is divided by it,
   a negative one multiplied;
6. ``frequency_penalty`` × (times the token occurs in the output) and ``presence_penalty`` ×
   (1 if it occurs) are subtracted.

Nothing is done (the input tensor is returned as is) when no parameter is active, so the common
path costs one attribute check. The functions never modify their input.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kvserve.sampling_params import SamplingParams

NEG_INF = float("-inf")


def needs_processing(params: SamplingParams) -> bool:
    return bool(params.allowed_token_ids is not None or params.bad_words_token_ids or params.min_tokens
                or params.logit_bias or params.repetition_penalty != 1.0 or params.presence_penalty
                or params.frequency_penalty)


def apply_logits_processors(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                            output_ids: Sequence[int], eos_ids: Iterable[int] = ()) -> torch.Tensor:
    """``logits``: one row ``[V]``, float32. Returns a new tensor (or ``logits`` if nothing applies)."""
    if not needs_processing(params):
        return logits
    out = logits.clone()
    vocab = out.shape[-1]
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        ids = [t for t in params.allowed_token_ids if t < vocab]
        if ids:
            keep[torch.tensor(ids, dtype=torch.long)] = True
        out = out.masked_fill(~keep, NEG_INF)
    banned = banned_by_bad_words(params.bad_words_token_ids, output_ids)
    if len(output_ids) < params.min_tokens:
        banned.update(eos_ids)
        banned.update(params.stop_token_ids)
    _mask(out, banned)
    if params.logit_bias:
        for tid, bias in params.logit_bias.items():
            if 0 <= tid < vocab:
                out[tid] += bias
    if params.repetition_penalty != 1.0:
        out = apply_repetition_penalty(out, list(prompt_ids) + list(output_ids), params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        out = apply_frequency_presence(out, output_ids, params.frequency_penalty, params.presence_penalty)
    return out


def _mask(logits: torch.Tensor, ids: set[int]) -> None:
    vocab = logits.shape[-1]
    valid = [t for t in ids if 0 <= t < vocab]
    if valid:
        logits[torch.tensor(valid, dtype=torch.long)] = NEG_INF


def banned_by_bad_words(words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> set[int]:
    """Token ids the next position must not take so that no word of ``words`` is completed."""
    banned: set[int] = set()
    for word in words:
        prefix = list(word[:-1])
        if not prefix or (len(output_ids) >= len(prefix) and list(output_ids[-len(prefix):]) == prefix):
            banned.add(word[-1])
    return banned


def apply_repetition_penalty(logits: torch.Tensor, seen: Sequence[int], penalty: float) -> torch.Tensor:
    """vLLM / HF: for every token seen (prompt or output), logit / penalty if > 0 else × penalty."""
    vocab = logits.shape[-1]
    ids = sorted({t for t in seen if 0 <= t < vocab})
    if not ids:
        return logits
    out = logits.clone()
    idx = torch.tensor(ids, dtype=torch.long)
    vals = out[idx]
    out[idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return out


def apply_frequency_presence(logits: torch.Tensor, output_ids: Sequence[int], frequency: float,
                             presence: float) -> torch.Tensor:
    """OpenAI: logit -= frequency × count(token in output) + presence × (count > 0)."""
    vocab = logits.shape[-1]
    ids = [t for t in output_ids if 0 <= t < vocab]
    if not ids:
        return logits
    counts = torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab).to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """After temperature: mask tokens whose probability is below ``min_p`` × the top probability."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, NEG_INF)


def bad_words_token_ids(tokenizer: Any, words: Iterable[str]) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids as it would appear at the start of the text and after a space
    (vLLM's rule); duplicates dropped."""
    seqs: list[tuple[int, ...]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in seqs:
                seqs.append(ids)
    return tuple(seqs)
