"""Prices turn the ledger into a cost: per response (``usage.cost``) and ``kvserve:cost_total``."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvserve.pricing import Prices
from tests.engine.conftest import write_tiny_llama
from tests.server.conftest import engine_config, start_server


def test_cost_by_hand() -> None:
    p = Prices(input=2.0, cached_input=0.5, output=8.0)
    c = p.cost(prompt_tokens=1000, cached_tokens=600, completion_tokens=100)
    assert c == {"input": 400 * 2.0 / 1e6, "cached_input": 600 * 0.5 / 1e6, "output": 100 * 8.0 / 1e6,
                 "total": (800 + 300 + 800) / 1e6, "saved_by_cache": 600 * 1.5 / 1e6}
    with pytest.raises(ValueError, match="price_output"):
        Prices(output=-1)


def test_the_server_prices_each_response_and_counts_the_total(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    prices = Prices(input=1_000_000.0, cached_input=250_000.0, output=2_000_000.0)  # $1 / token: readable
    srv = start_server(model, engine_config(model), max_waiting=None, prices=prices)
    try:
        body = {"model": "tiny", "prompt": list(range(100, 140)), "max_tokens": 3, "temperature": 0}
        first = httpx.post(srv.v1 + "/completions", json=body, timeout=60).json()["usage"]
        second = httpx.post(srv.v1 + "/completions", json=body, timeout=60).json()["usage"]
        m = srv.metrics()
    finally:
        srv.stop()
    assert first["cost"] == {"input": 40.0, "cached_input": 0.0, "output": 6.0, "total": 46.0, "saved_by_cache": 0.0}
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached == 36  # 9 full blocks of 4 (one token always recomputed)
    assert second["cost"]["input"] == 40 - cached and second["cost"]["cached_input"] == cached * 0.25
    assert second["cost"]["saved_by_cache"] == cached * 0.75
    assert m[("kvserve:cost_total", (("kind", "input"),))] == 40 + (40 - cached)
    assert m[("kvserve:cost_total", (("kind", "saved_by_cache"),))] == cached * 0.75
