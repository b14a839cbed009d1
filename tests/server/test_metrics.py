"""``/metrics`` parsed with prometheus_client's parser, checked against the engine's own counts."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import BLOCK_SIZE, MODEL_NAME, wait_until

GAUGES = ["kv_blocks_total", "kv_blocks_used", "kv_blocks_cached_free", "kv_blocks_pinned", "kv_cache_usage_ratio",
          "kv_tokens_held", "kv_slots_in_used_blocks", "kv_fragmentation_ratio", "running_seq_len_avg",
          "running_seq_len_max", "num_requests_running", "num_requests_waiting", "sessions_active",
          "kv_bytes_per_token", "kv_token_capacity"]
COUNTERS = ["prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
            "sessions_expired_total", "sessions_evicted_total", "prompt_tokens_total", "generation_tokens_total"]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_kv_gib_seconds"]


def m(sample: dict, name: str, **labels: str) -> float:
    return sample.get(("kvserve:" + name, tuple(sorted(labels.items()))), 0.0)


def test_every_issue_metric_is_exposed_with_the_prefix(live):
    text = httpx.get(live.url + "/metrics").text
    for name in GAUGES + COUNTERS:
        assert f'kvserve:{name}{{model_name="{MODEL_NAME}"}}' in text, name
    for name in HISTOGRAMS:
        assert f"kvserve:{name}_bucket{{" in text and f"kvserve:{name}_count{{" in text, name
    assert "process_resident_memory_bytes" in text


def test_kernel_choices_are_exposed_one_series_per_role_and_band(live):
    from prometheus_client.parser import text_string_to_metric_families

    from kvserve.native.choices import choices

    text = httpx.get(live.url + "/metrics").text
    fam = {f.name: f for f in text_string_to_metric_families(text)}["kvserve:kernel_choice"]
    got = {(s.labels["role"], s.labels["band"]): s.labels["choice"] for s in fam.samples}
    assert {s.value for s in fam.samples} == {1.0}
    assert got == {(c.role, c.band): c.choice for c in choices()}
    assert {("gemm_qkv", "rows<=1"), ("gemm_lm_head", "rows<=128"), ("gemm_lm_head", "rows>128")} <= set(got)


def test_request_metrics_match_what_the_requests_returned(live, client):
    before = live.metrics()
    usages = [client.completions.create(model=MODEL_NAME, prompt=f"metric check {i}", max_tokens=4 + i,
                                        temperature=0).usage for i in range(3)]
    after = live.metrics()

    def delta(name: str, **labels: str) -> float:
        return m(after, name, **labels) - m(before, name, **labels)

    assert delta("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("request_success_total", finish_reason="length") == 3
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_kv_gib_seconds"):
        assert delta(h + "_count") == 3, h
    # one gap per generated token after the first
    assert delta("inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    assert 0 < delta("time_to_first_token_seconds_sum") <= delta("e2e_request_latency_seconds_sum")
    # KV × time is positive and no more than the whole pool held for the whole time
    eng = live.engine.engine
    pool_gib = eng.capacity.num_blocks * eng.capacity.block_size * eng.capacity.bytes_per_token / 2**30
    assert 0 < delta("request_kv_gib_seconds_sum") <= delta("e2e_request_latency_seconds_sum") * pool_gib


def test_engine_gauges_and_counters_equal_the_engine_stats(live, client):
    sid = "metrics-session"
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "pin me"}],
                                   max_tokens=6, temperature=0, extra_body={"session_id": sid})
    try:
        sample = live.metrics()
        st = live.engine.call_blocking(lambda e: e.stats())
        cap = live.engine.engine.capacity
        assert m(sample, "kv_blocks_total") == st.blocks_total == cap.num_blocks
        assert m(sample, "kv_blocks_used") == st.blocks_used
        assert m(sample, "kv_blocks_cached_free") == st.blocks_cached_free
        assert m(sample, "kv_blocks_pinned") == st.blocks_pinned > 0
        assert m(sample, "kv_cache_usage_ratio") == pytest.approx(st.blocks_used / st.blocks_total)
        assert m(sample, "prefix_cache_queries_total") == st.prefix_queries
        assert m(sample, "prefix_cache_hits_total") == st.prefix_hits
        assert m(sample, "num_preemptions_total") == st.num_preemptions
        assert m(sample, "sessions_active") == st.sessions_active >= 1
        assert m(sample, "kv_bytes_per_token") == cap.bytes_per_token
        assert m(sample, "kv_token_capacity") == cap.num_blocks * BLOCK_SIZE
        assert m(sample, "num_requests_running") == 0 and m(sample, "num_requests_waiting") == 0
        # idle: only sessions hold KV; a session holds its tokens but the last (not yet computed)
        sessions = httpx.get(live.v1 + "/sessions").json()["data"]
        held = sum(s["num_tokens"] - 1 for s in sessions if s["resident"])
        assert m(sample, "kv_tokens_held") == held
        assert m(sample, "kv_slots_in_used_blocks") == st.blocks_used * BLOCK_SIZE
        assert m(sample, "kv_fragmentation_ratio") == pytest.approx(1 - held / (st.blocks_used * BLOCK_SIZE))
    finally:
        httpx.delete(f"{live.v1}/sessions/{sid}")


def test_running_request_shows_in_queue_and_sequence_gauges(live):
    body = {"model": MODEL_NAME, "prompt": list(range(10, 30)), "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.v1 + "/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        sample = live.metrics()
        assert m(sample, "num_requests_running") == 1
        assert 20 < m(sample, "running_seq_len_max") <= 220
        assert m(sample, "running_seq_len_avg") == m(sample, "running_seq_len_max")
        assert m(sample, "kv_blocks_used") >= 20 // BLOCK_SIZE
    wait_until(lambda: m(live.metrics(), "num_requests_running") == 0, what="the stream to be aborted")
