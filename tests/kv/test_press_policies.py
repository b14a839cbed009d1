"""The eviction policies' choices, by hand: windows, SnapKV and H2O at block granularity."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.kv.press import PressSpec, droppable, parse_press, peak_blocks
from kvserve.kv.press.importance import h2o_drops, snapkv_drops


def test_droppable_keeps_sinks_and_the_window() -> None:
    # n = 20, W = 8: queries from 20 on read keys > 12; blocks of 4 wholly <= 12: 0, 1, 2
    assert list(droppable(20, 4, 8)) == [0, 1, 2]
    assert list(droppable(20, 4, 8, sinks=4)) == [1, 2]  # block 0 holds the sinks
    assert list(droppable(20, 4, None)) == []


@given(n=st.integers(0, 300), bs=st.sampled_from([1, 2, 4, 16]), w=st.integers(1, 64), s=st.integers(0, 20))
def test_a_dropped_block_is_never_read_again(n: int, bs: int, w: int, s: int) -> None:
    """Every key of a droppable block is hidden from every query at position >= n."""
    for i in droppable(n, bs, w, s):
        for k in range(i * bs, (i + 1) * bs):
            assert k >= s and k <= n - w  # query q >= n reads k only if k > q - w or k < s


@given(total=st.integers(1, 400), bs=st.sampled_from([1, 4, 16]), w=st.integers(1, 64), c=st.integers(1, 32))
def test_peak_blocks_bounds_what_a_sequence_holds(total: int, bs: int, w: int, c: int) -> None:
    """Simulate steps of c tokens dropping behind the window: the table never holds more."""
    done, most = 0, 0
    while done < total:
        n = min(c, total - done)
        held = -(-(done + n) // bs) - len(droppable(done, bs, w))
        most = max(most, held)
        done += n
    assert most <= peak_blocks(total, bs, w, c)


def test_snapkv_drops_the_least_attended_unshared_prompt_blocks() -> None:
    spec = PressSpec("snapkv", ratio=0.5, sink_tokens=4, recent_tokens=8)
    scores = [9.0, 0.1, 5.0, 0.2, 0.3, 7.0, 1.0, 1.0]  # 8 prompt blocks of 4 = 32 tokens
    held, shared = [True] * 8, [False] * 8
    # candidates: blocks 1..5 (0 holds sinks, 6-7 the last 8 tokens); drop 4 of them, lowest first
    assert snapkv_drops(spec, scores, held, shared, 32, 4) == [1, 2, 3, 4]
    shared[1] = True  # another request holds it: left alone, dropping it frees nothing
    assert snapkv_drops(spec, scores, held, shared, 32, 4) == [2, 3, 4, 5]


def test_h2o_keeps_a_budget_of_heavy_hitters() -> None:
    spec = PressSpec("h2o", ratio=0.5, sink_tokens=4, recent_tokens=4)
    scores = [5.0, 0.5, 3.0, 0.1, 2.0, 0.0]
    held = [True] * 6
    assert h2o_drops(spec, scores, held, [False] * 6, 24, 4) == [1, 3, 4]  # keep 3 of 6
    held = [True, False, True, False, False, True]
    assert h2o_drops(spec, scores, held, [False] * 6, 24, 4) == []          # already within budget


def test_parse_press() -> None:
    assert parse_press("sinks:4,128") == PressSpec("sinks", sink_tokens=4, window_tokens=128)
    assert parse_press("snapkv:0.5").ratio == 0.5
    with pytest.raises(ValueError, match="cannot read"):
        parse_press("h2o")
    with pytest.raises(ValueError, match="unknown KV eviction policy"):
        parse_press("tova:0.5")
