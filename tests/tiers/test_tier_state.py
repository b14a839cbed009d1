"""Tier bookkeeping under random workloads: bytes and LRU order stay in sync with what each tier
holds, and the scheduler-side index fed only by tier events equals every local tier's contents."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.contract import BlockPayload
from kvserve.kv.tiers.disk import DiskTier
from kvserve.kv.tiers.host import HostTier
from kvserve.kv.tiers.index import TierIndex
from kvserve.kv.tiers.stack import TierStack

ROOT = b"r" * 16
OPS = st.lists(st.tuples(st.sampled_from(["save", "load"]), st.integers(0, 30), st.integers(1, 6)), max_size=60)


def payload(n: int) -> BlockPayload:
    return BlockPayload("int8", 4, 1, 8, 4, [bytes([n % 256]) * (40 * n)], [b"v" * 8])


@settings(max_examples=40, deadline=None)
@given(OPS)
def test_the_index_follows_the_tiers_exactly(ops: list[tuple[str, int, int]]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        host, disk = HostTier(1500), DiskTier(Path(d), 3000, fsync=False)
        stack = TierStack([host, disk], ROOT)
        index = TierIndex(["host", "disk"])
        for op, k, size in ops:
            key = k.to_bytes(16, "little")
            if op == "save":
                index.apply(stack.save(key, b"", payload(size)))
            else:
                got, tier, events = stack.load(key)
                index.apply(events)
                assert (got is None) == (tier is None)
                if got is not None:
                    assert index.best(key) == tier  # the index would have sent us to that tier first
            host.check()
            disk.check()
            assert {t: {k for k, _ in items} for t, items in stack.snapshot().items()} == \
                {t: index._held[t] for t in ("host", "disk")}
            assert {t: sum(n for _, n in items) for t, items in stack.snapshot().items()} == \
                {t: index.counters[t].bytes for t in ("host", "disk")}
        rebuilt = DiskTier(Path(d), 3000)  # a restart: the directory is the index
        assert set(rebuilt.keys()) == set(disk.keys()) and rebuilt.nbytes == disk.nbytes
