"""``/metrics`` series with a ``replica`` label, and the router's decisions by reason.

Read at scrape time from the :class:`~kvserve.cluster.replica_set.ReplicaSet` (its last polls
and counters; no call to a replica), so a dead replica still shows, as ``replica_up 0``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

P = "kvserve:"
LOAD_GAUGES: list[tuple[str, str, str]] = [
    ("replica_num_requests_running", "Requests in the replica's running batch.", "num_running"),
    ("replica_num_requests_waiting", "Requests waiting on the replica.", "num_waiting"),
    ("replica_kv_blocks_free", "Free KV blocks in the replica's pool.", "blocks_free"),
    ("replica_kv_blocks_total", "KV blocks in the replica's pool.", "blocks_total"),
]
SERVED: list[tuple[str, str]] = [
    ("requests", "Requests the replica finished."),
    ("prompt_tokens", "Prompt tokens of requests the replica finished."),
    ("cached_tokens", "Prompt tokens the replica reused from its cache or tiers."),
    ("generation_tokens", "Tokens the replica generated."),
]


class ReplicaCollector(Collector):
    def __init__(self, replica_set: Any, model_name: str) -> None:
        self.rs = replica_set
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        rs, m = self.rs, self.model_name
        names = sorted(rs.replicas)
        up = GaugeMetricFamily(P + "replica_up", "1 while the replica answers, 0 once it is down.",
                               labels=["model_name", "replica"])
        for n in names:
            up.add_metric([m, n], 1.0 if rs.replicas[n].up else 0.0)
        yield up
        for name, doc, attr in LOAD_GAUGES:
            g = GaugeMetricFamily(P + name, doc, labels=["model_name", "replica"])
            for n in names:
                g.add_metric([m, n], float(getattr(rs.replicas[n].load, attr)))
            yield g
        idx = GaugeMetricFamily(P + "router_index_blocks", "Blocks the router's index places on the replica, "
                                "per tier (fed by the replica's cache events).", labels=["model_name", "replica", "tier"])
        for n in names:
            for tier, hashes in sorted(rs.index.held(n).items()):
                idx.add_metric([m, n, tier], float(len(hashes)))
        yield idx
        for key, doc in SERVED:
            c = CounterMetricFamily(P + "replica_" + key, doc, labels=["model_name", "replica"])
            for n in names:
                c.add_metric([m, n], float(rs.served.get(n, {}).get(key, 0)))
            yield c
        led = rs.transfers
        for key, doc in (("transfers", "KV transfers between replicas that completed (P/D, session moves)."),
                         ("blocks", "KV blocks moved between replicas and made findable by the receiver."),
                         ("bytes", "Bytes of KV block objects sent between replicas."),
                         ("seconds", "Seconds spent moving KV between replicas."),
                         ("fallbacks", "Transfers that failed or were too slow: the receiver computed."),
                         ("sessions_moved", "Sessions moved off an overloaded replica, with their KV.")):
            c = CounterMetricFamily(P + "pd_transfer_" + key, doc, labels=["model_name"])
            c.add_metric([m], float(getattr(led, key)))
            yield c
        d = CounterMetricFamily(P + "router_decisions", "Routing decisions by reason (sticky, moved, "
                                "prefix, least_loaded, round_robin, session_hash).", labels=["model_name", "reason"])
        for reason, count in sorted(rs.policy.decisions.items()):
            d.add_metric([m, reason], float(count))
        yield d
