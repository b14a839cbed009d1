"""The cluster's :class:`EngineSnapshot`: the replicas' snapshots added up (what ``/metrics`` and
the dashboard read without a ``replica`` label). Counts and sizes add; ``seq_len_max`` and
``max_model_len`` take the maximum; ``seq_len_avg`` is weighted by running requests; per-token
sizes (``kv_bytes_per_token``) are the replicas' own (they are equal). Plain Python."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvserve.engine.async_views import EngineSnapshot

_MAX = {"seq_len_max", "max_model_len", "kv_bytes_per_token", "block_size"}


def merge_snapshots(snaps: Sequence[EngineSnapshot]) -> EngineSnapshot:
    if not snaps:
        raise ValueError("no replica snapshot to merge")
    out: dict[str, object] = {}
    for f in dataclasses.fields(EngineSnapshot):
        values = [getattr(s, f.name) for s in snaps]
        if f.name == "tiers":
            tiers: dict[str, dict[str, object]] = {}
            for v in values:
                for tier, stats in v.items():
                    acc = tiers.setdefault(tier, {})
                    for k, x in stats.items():
                        if isinstance(x, list):  # a histogram's buckets: added bucket by bucket
                            have = acc.get(k)
                            acc[k] = [a + b for a, b in zip(have, x)] if isinstance(have, list) else list(x)
                        else:
                            acc[k] = min(acc.get(k, x), x) if k == "up" else acc.get(k, 0.0) + x  # type: ignore[operator]
            out[f.name] = tiers
        elif f.name == "seq_len_avg":
            running = sum(s.num_running for s in snaps)
            out[f.name] = sum(s.seq_len_avg * s.num_running for s in snaps) / running if running else 0.0
        elif f.name in _MAX:
            out[f.name] = max(values)
        else:
            out[f.name] = sum(values)
    return EngineSnapshot(**out)  # type: ignore[arg-type]
