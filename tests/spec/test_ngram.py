"""The n-gram proposer and the drafter's rules, without a model."""

from __future__ import annotations

import pytest

from kvserve.config import SpeculativeConfig
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.spec.drafter import Drafter
from kvserve.spec.ngram import NgramIndex


def index(tokens: list[int], lo: int = 2, hi: int = 4) -> NgramIndex:
    ix = NgramIndex(lo, hi)
    ix.extend(tokens)
    return ix


def test_copies_what_followed_the_most_recent_earlier_occurrence():
    ix = index([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3])
    assert ix.propose(2) == [8, 5]  # the later "1 2 3" was followed by 8 5, the earlier by 9


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    # "7 1 2" occurred at the start (then 4); "1 2" alone more recently (then 6)
    ix = index([7, 1, 2, 4, 1, 2, 6, 7, 1, 2], lo=2, hi=3)
    assert ix.propose(1) == [4]
    assert index([7, 1, 2, 4, 1, 2, 6, 7, 1, 2], lo=2, hi=2).propose(1) == [6]


def test_nothing_to_copy_proposes_nothing_and_the_suffix_never_matches_itself():
    assert index([1, 2, 3, 4, 5]).propose(4) == []
    assert index([1, 2]).propose(3) == []
    assert index([]).propose(3) == []


def test_a_loop_drafts_past_its_period():
    assert index([5, 6, 5, 6, 5, 6]).propose(5) == [5, 6, 5, 6, 5]


def test_extending_piecewise_equals_extending_at_once():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 3, 1, 4, 1]
    ix = NgramIndex(1, 3)
    for t in seq:
        ix.extend([t])
    assert ix.propose(3) == index(seq, 1, 3).propose(3) == [5, 9, 2]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        NgramIndex(3, 2)
    with pytest.raises(ValueError):
        SpeculativeConfig("ngram", ngram_min=0)
    with pytest.raises(ValueError):
        SpeculativeConfig("eagle")


def decoding(tokens: list[int], max_tokens: int, **params) -> Request:
    req = Request("r", tokens[:4], SamplingParams(max_tokens=max_tokens, temperature=0, **params))
    req.output_token_ids = tokens[4:]
    req.num_computed_tokens = req.num_tokens - 1
    return req


def test_drafts_stop_short_of_max_tokens_and_skip_grammars_and_prefills():
    drafter = Drafter(SpeculativeConfig("ngram", num_speculative_tokens=8))
    seq = [1, 2, 3, 4] * 4
    assert len(drafter.propose(decoding(seq, 15), 100)) == 15 - 12 - 1
    assert len(drafter.propose(decoding(seq, 100), 5)) == 5  # the step's token budget
    assert drafter.propose(decoding(seq, 13), 100) == []
    assert drafter.propose(decoding(seq, 100, response_format={"type": "json_object"}), 100) == []
    prefill = decoding(seq, 100)
    prefill.num_computed_tokens = 0
    assert drafter.propose(prefill, 100) == []


def test_the_draft_length_follows_what_verifies_keep():
    drafter = Drafter(SpeculativeConfig("ngram", num_speculative_tokens=8))
    req = decoding([1, 2, 3, 4] * 4, 100)
    assert len(drafter.propose(req, 100)) == 8
    drafter.verified(req, 8, 0)
    assert drafter.propose(req, 100) == []  # paused one step
    assert len(drafter.propose(req, 100)) == 4
    drafter.verified(req, 4, 0)
    assert [drafter.propose(req, 100) for _ in range(2)] == [[], []]  # paused two steps
    assert len(drafter.propose(req, 100)) == 2
    drafter.verified(req, 2, 2)
    assert len(drafter.propose(req, 100)) == 4  # all kept: doubled
    drafter.verified(req, 4, 4)
    assert len(drafter.propose(req, 100)) == 8
    drafter.verified(req, 8, 8)
    assert len(drafter.propose(req, 100)) == 8  # capped at num_speculative_tokens
    drafter.verified(req, 8, 2)
    assert len(drafter.propose(req, 100)) == 3  # some kept: one more than that
    assert (drafter.stats.verifies, drafter.stats.proposed, drafter.stats.accepted) == (6, 34, 16)
