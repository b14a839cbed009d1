"""The cluster's snapshot adds the replicas' up, as /metrics reads it without a replica label."""

from __future__ import annotations

import dataclasses

from kvserve.cluster.snapshots import merge_snapshots
from kvserve.engine.async_views import EngineSnapshot

BASE = EngineSnapshot(num_running=0, num_waiting=0, blocks_total=64, blocks_used=0, blocks_cached_free=0,
                      blocks_pinned=0, block_size=4, tokens_held=0, slots_in_used_blocks=0, seq_len_avg=0.0,
                      seq_len_max=0, prefix_queries=0, prefix_hits=0, num_preemptions=0, sessions_active=0,
                      sessions_expired=0, sessions_evicted=0, kv_bytes_per_token=512, token_capacity=256,
                      max_model_len=256)


def test_counts_add_sizes_stay_and_the_average_length_is_weighted_by_running_requests() -> None:
    a = dataclasses.replace(BASE, num_running=1, seq_len_avg=10.0, seq_len_max=10, blocks_used=8, prefix_hits=4,
                            tiers={"remote": {"blocks": 3.0, "up": 1.0, "load_buckets": [1, 0, 2]}})
    b = dataclasses.replace(BASE, num_running=3, seq_len_avg=30.0, seq_len_max=40, blocks_used=16, prefix_hits=6,
                            tiers={"remote": {"blocks": 5.0, "up": 0.0, "load_buckets": [0, 4, 1]}})
    m = merge_snapshots([a, b])
    assert (m.num_running, m.blocks_total, m.blocks_used, m.prefix_hits) == (4, 128, 24, 10)
    assert (m.block_size, m.kv_bytes_per_token, m.max_model_len, m.seq_len_max) == (4, 512, 256, 40)
    assert m.seq_len_avg == (10 * 1 + 30 * 3) / 4
    assert m.token_capacity == 512 and m.kv_usage_ratio == 24 / 128
    # a tier is up only where it is up everywhere; a load-latency histogram adds bucket by bucket
    assert m.tiers == {"remote": {"blocks": 8.0, "up": 0.0, "load_buckets": [1, 4, 3]}}
