"""Speed and cost bounds: the formulas, checked against hand computations."""

from __future__ import annotations

import pytest

from kvserve.planner.inputs import PlanRequest
from kvserve.planner.performance import cost_per_million_tokens, decode_batches
from kvserve.planner.plan import build_plan

from .conftest import plan_json


def _plan(**kw: str):  # type: ignore[no-untyped-def]
    return build_plan(PlanRequest(**{"model": "llama-3-8b", "hardware": "h100", **kw}))


def test_decode_bound_is_weights_plus_kv_over_bandwidth() -> None:
    plan = _plan()
    assert plan.perf is not None
    row = plan.perf.decode(8, 4096)
    assert row is not None
    weights = 8_030_261_248 * 2
    kv = 8 * 4096 * 131072
    assert row.weights_read_bytes == pytest.approx(weights)
    assert row.kv_read_bytes == kv
    assert row.time_per_token_s == pytest.approx((weights + kv) / 3350e9)
    assert row.tokens_per_s == pytest.approx(8 / row.time_per_token_s)


def test_tensor_parallel_divides_the_bytes_each_gpu_reads() -> None:
    one, four = _plan(), _plan(tp="4")
    assert one.perf is not None and four.perf is not None
    r1, r4 = one.perf.decode(4, 2048), four.perf.decode(4, 2048)
    assert r1 is not None and r4 is not None
    assert r4.time_per_token_s == pytest.approx(r1.time_per_token_s / 4)


def test_prefill_flops_dense_causal() -> None:
    plan = _plan()
    assert plan.perf is not None
    p = 2048
    matmul_params = 8_030_261_248 - 2 * 525_336_576  # embedding lookup and lm_head (last token) aside
    attention = 2 * 32 * (128 + 128) * 32 * p * (p + 1) // 2
    expected = 2 * matmul_params * p + 2 * 128256 * 4096 + attention
    assert plan.perf.prefill_flops(p) == pytest.approx(expected)
    assert plan.perf.prefill_time(p) == pytest.approx(expected / 989.5e12)


def test_prefill_attention_honours_windows() -> None:
    plan = build_plan(PlanRequest(model="mistral-7b-v0.1", hardware="h100"))
    assert plan.perf is not None
    short, long = plan.perf.prefill_flops(4096), plan.perf.prefill_flops(8192)
    linear = 2 * (7_241_732_096 - 2 * 131_072_000)
    pairs_long = 4096 * 4097 // 2 + 4096 * 4096
    per_pair = 2 * 32 * 256 * 32
    assert long - short == pytest.approx(linear * 4096 + per_pair * (pairs_long - 4096 * 4097 // 2))


def test_cost_per_million_tokens() -> None:
    assert cost_per_million_tokens(3.6, 1, 1000.0) == pytest.approx(1.0)
    assert cost_per_million_tokens(2.0, 4, 2000.0) == pytest.approx(2.0 * 4 / 3600 / 2000 * 1e6)


def test_decode_batches() -> None:
    assert decode_batches(40, 12) == [1, 2, 4, 8, 12, 16, 32, 40]
    assert decode_batches(1) == [1]
    assert decode_batches(8, 100) == [1, 2, 4, 8]


def test_request_gib_seconds_matches_the_sum(cli) -> None:  # type: ignore[no-untyped-def]
    d = plan_json(
        cli,
        "--model",
        "llama-3-8b",
        "--memory",
        "80GiB",
        "--bandwidth",
        "1000",
        "--tflops",
        "100",
        "--prompt-tokens",
        "1000",
        "--output-tokens",
        "10",
        "--concurrency",
        "2",
        "--price-per-hour",
        "2",
    )
    r = d["request"]
    assert r["batch"] == 2
    per_token = 131072
    weights = 8_030_261_248 * 2
    prefill = r["prefill_flops"] / 100e12
    total = 1000 * per_token * prefill
    for i in range(1, 11):
        tpot = (weights + 2 * (1000 + i) * per_token) / 1e12
        total += (1000 + i) * per_token * tpot
    assert r["prefill_time_s"] == pytest.approx(prefill)
    assert r["gib_seconds"] == pytest.approx(total / 2**30)
    assert r["kv_rent_usd"] == pytest.approx(
        2 / 3600 * r["gib_seconds"] / (d["ledger"]["kv_budget_bytes"] / 2**30)
    )
    rows = {row["batch"]: row for row in d["decode"]["rows"]}
    assert rows[2]["usd_per_million_output_tokens"] == pytest.approx(2 / 3600 / rows[2]["tokens_per_s"] * 1e6)


def test_no_bandwidth_no_decode_rows(cli) -> None:  # type: ignore[no-untyped-def]
    d = plan_json(cli, "--model", "llama-3-8b", "--kv-cache-memory", "8GiB")
    assert d["decode"] is None and d["hardware"] is None
    assert d["request"]["gib_seconds"] is None
