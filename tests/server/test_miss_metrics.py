"""``usage.kv.miss_tokens`` and ``kvserve:prefix_cache_miss_tokens{reason}`` from the ledger."""

from __future__ import annotations

from kvserve.engine.async_views import FinishedRequest
from kvserve.request import RequestOutput
from kvserve.server.metrics import ServerMetrics
from kvserve.server.params import usage_of


def test_usage_sums_miss_reasons_over_outputs() -> None:
    outs = [RequestOutput("a", None, list(range(10)), [], True, kv_miss_tokens={"never_seen": 8, "partial_block": 2}),
            RequestOutput("b", None, list(range(10)), [], True, num_cached_tokens=8,
                          kv_miss_tokens={"partial_block": 2})]
    kv = usage_of(outs).kv
    assert kv.miss_tokens == {"never_seen": 8, "partial_block": 4}
    assert sum(kv.miss_tokens.values()) == kv.recomputed_tokens == 12


def test_counter_per_reason() -> None:
    m = ServerMetrics("tiny")
    m.on_finished(FinishedRequest("a", "stop", 10, 1, 0, None, None, 1.0, 0.0,
                                  kv_miss_tokens={"evicted:lru": 8, "partial_block": 2}), 0.0)
    text = m.render().decode()
    assert 'kvserve:prefix_cache_miss_tokens_total{model_name="tiny",reason="evicted:lru"} 8.0' in text
    assert 'kvserve:prefix_cache_miss_tokens_total{model_name="tiny",reason="partial_block"} 2.0' in text
