"""Tier eviction policies: exact orders for LRU and S3-FIFO, S3-FIFO's scan resistance, and a
hypothesis check that both hand out each held key exactly once."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvserve.kv.eviction import make_policy
from kvserve.kv.tiers.host import HostTier


def test_lru_evicts_the_least_recently_used() -> None:
    p = make_policy("lru", [])
    for k in "abc":
        p.push(k)
    p.touch("a")
    assert [p.pop(), p.pop(), p.pop()] == ["b", "c", "a"]


def test_s3fifo_keeps_reused_entries_through_a_scan() -> None:
    p = make_policy("s3fifo", [])
    for k in ("sys", "conv"):
        p.push(k)
        p.touch(k)  # used again
    for i in range(20):  # a one-off document: 20 entries never reused
        p.push(f"doc{i}")
        if len(p) > 10:
            p.pop()
    assert "sys" in p and "conv" in p  # LRU would have evicted both
    lru = make_policy("lru", [])
    for k in ("sys", "conv"):
        lru.push(k)
        lru.touch(k)
    for i in range(20):
        lru.push(f"doc{i}")
        if len(lru) > 10:
            lru.pop()
    assert "sys" not in lru and "conv" not in lru


def test_a_ghost_hit_goes_straight_to_main() -> None:
    p = make_policy("s3fifo", [])
    p.push("x")
    assert p.pop() == "x"  # one hit: out through the small queue, remembered as a ghost
    p.push("x")
    for i in range(5):
        p.push(f"n{i}")
    assert p.pop() == "n0"  # x came back from the ghost list into main: the small queue goes first


@given(st.sampled_from(["lru", "s3fifo"]), st.lists(st.tuples(st.sampled_from("ptr"), st.integers(0, 12)), max_size=80))
def test_every_key_is_handed_out_once(policy: str, ops: list[tuple[str, int]]) -> None:
    p = make_policy(policy, [])
    held: set[int] = set()
    for op, k in ops:
        if op == "p" and k not in held:
            p.push(k)
            held.add(k)
        elif op == "t" and k in held:
            p.touch(k)
        elif op == "r" and held:
            victim = p.pop()
            assert victim in held
            held.discard(victim)
        assert len(p) == len(held) and set(p) == held


def test_a_host_tier_under_s3fifo_stays_within_capacity() -> None:
    tier = HostTier(100, eviction="s3fifo")
    for i in range(50):
        tier.put(i.to_bytes(2, "little"), b"x" * 30)
        tier.check()
        assert tier.nbytes <= 100
