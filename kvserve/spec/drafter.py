"""The scheduler's drafter: which requests get drafts this step, how many, and what they are.

Plain Python (no torch): it lives beside the scheduler. With ``method="ngram"`` it keeps, per
request, an :class:`~kvserve.spec.ngram.NgramIndex` over the request's tokens, extended as tokens
arrive; a session turn's prompt already holds the session's whole history (previous prompts and
replies), and the index of a session's last turn is kept and extended by its next turn instead
of rebuilt. With ``method="draft"`` the drafts are :data:`DRAFT_PLACEHOLDER` tokens: the chunk
says how many (``ScheduledChunk.model_drafts``) and the runner's draft model writes the real ones
before the forward (:mod:`kvserve.runner.draft_runner`). The scheduler never needs their values:
verification returns the target's own tokens, and the drafts it kept are among them.

Rules (invariants the scheduler relies on):

- drafts go only to a request that is decoding (exactly one token to compute), has no grammar
  (``response_format``: its matcher advances token by token), uses the engine's own KV codec
  and no KV eviction policy (``kv_press``: what a verify row may see would depend on drops);
- a request is never drafted past ``max_tokens``: ``len(drafts) <= max_tokens - generated - 1``,
  so every slot a verify writes is inside the ``prompt + max_tokens`` its admission reserved;
- nobody is drafted while more than ``max_num_seqs`` requests run (auto-off for big batches);
- the draft length follows what verifies keep: all accepted doubles it (up to
  ``num_speculative_tokens``), some accepted sets it to one more than were kept, none halves it
  and pauses the request's drafting for 1, 2, 4 … 16 steps. A verify costs more per draft token
  than it looks (every draft row needs its own logits: on the 0.5B shape a 9-token verify costs
  2x a decode on a 2-core AVX2 CPU), so drafts stay as long as they are accepted and text with
  nothing to copy costs a few short verifies, not one per step.

Greedy and seeded rows both verify exactly: a draw is a pure function of (seed, output index)
(``runner/sampler.py``), a draft is accepted only where it equals the token the request would
have drawn there anyway, so output is the same token for token with and without drafting.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvserve.request import Request
from kvserve.spec.config import SpeculativeConfig
from kvserve.spec.ngram import NgramIndex

DRAFT_PLACEHOLDER = -1  # a draft slot the runner's draft model fills (never a real token id)
_MAX_PAUSE = 16
_SESSION_INDEXES = 64  # session indexes kept between turns (LRU)


@dataclass
class SpecStats:
    """Cumulative: verify chunks run, draft tokens proposed, draft tokens accepted."""

    verifies: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class _Track:
    index: NgramIndex | None  # None: a draft model proposes
    k: int
    pause: int = 0   # steps to skip before drafting again
    misses: int = 0  # verifies in a row that accepted nothing


class Drafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecStats()
        self._tracks: dict[str, _Track] = {}
        self._sessions: OrderedDict[str, NgramIndex] = OrderedDict()

    def active(self, num_running: int) -> bool:
        """Drafting pays this step: few enough requests run that verifying costs less than it saves."""
        return num_running <= self.config.max_num_seqs

    def propose(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding ``req`` (at most ``budget``; ``[]`` when it is not eligible)."""
        params = req.sampling_params
        limit = min(budget, params.max_tokens - len(req.output_token_ids) - 1)
        if (limit <= 0 or req.num_tokens - req.num_computed_tokens != 1 or params.response_format is not None
                or req.kv_cache_dtype is not None or req.kv_press is not None):
            return []
        track = self._track(req)
        if track.pause:
            track.pause -= 1
            return []
        if track.index is None:
            return [DRAFT_PLACEHOLDER] * min(limit, track.k)
        track.index.extend(req.token_ids_from(len(track.index)))
        return track.index.propose(min(limit, track.k))

    def verified(self, req: Request, proposed: int, accepted: int) -> None:
        """The verify of ``proposed`` drafts kept ``accepted`` of them."""
        self.stats.verifies += 1
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        track = self._tracks.get(req.request_id)
        if track is None:
            return
        if accepted == proposed:
            track.k, track.misses = min(self.config.num_speculative_tokens, 2 * proposed), 0
        elif accepted:
            track.k, track.misses = accepted + 1, 0
        else:
            track.k = max(1, track.k // 2)
            track.misses += 1
            track.pause = min(_MAX_PAUSE, 2 ** (track.misses - 1))

    def forget(self, req: Request) -> None:
        """``req`` finished: drop its state; a session keeps its index for the next turn."""
        track = self._tracks.pop(req.request_id, None)
        if track is not None and track.index is not None and req.session_id is not None:
            self._sessions[req.session_id] = track.index
            self._sessions.move_to_end(req.session_id)
            while len(self._sessions) > _SESSION_INDEXES:
                self._sessions.popitem(last=False)

    def _track(self, req: Request) -> _Track:
        track = self._tracks.get(req.request_id)
        if track is None:
            index = None if self.config.by_model else (
                self._session_index(req) or NgramIndex(self.config.ngram_min, self.config.ngram_max))
            track = self._tracks[req.request_id] = _Track(index, self.config.num_speculative_tokens)
        return track

    def _session_index(self, req: Request) -> NgramIndex | None:
        """The session's index from its last turn, when this turn's tokens continue it."""
        if req.session_id is None:
            return None
        index = self._sessions.pop(req.session_id, None)
        if index is None or len(index) > req.num_tokens or index.tokens != req.all_token_ids[:len(index)]:
            return None
        return index
