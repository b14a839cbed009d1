"""``kvserve plan`` prices a typical request with the server's own prices and code
(:class:`kvserve.pricing.Prices`): the cached share in whole blocks, and the break-even rate
against a GPU-hour price."""

from __future__ import annotations

from kvserve.pricing import Prices

from .conftest import plan_json


def test_the_plan_prices_a_request_as_the_server_would(cli) -> None:  # type: ignore[no-untyped-def]
    d = plan_json(cli, "--model", "llama-3-8b", "--hardware", "h100", "--prompt-tokens", "1000",
                  "--output-tokens", "100", "--price-input", "3", "--price-cached-input", "0.3",
                  "--price-output", "15", "--cached-fraction", "0.75", "--price-per-hour", "4", "--block-size", "16")
    priced = d["request"]["price"]
    assert priced["cached_tokens"] == 736  # 750 rounded down to whole 16-token blocks
    assert priced["cost_usd"] == Prices(3, 0.3, 15).cost(1000, 736, 100)
    assert priced["break_even_requests_per_gpu_hour"] == 4 / priced["cost_usd"]["total"]


def test_without_prices_there_is_no_price(cli) -> None:  # type: ignore[no-untyped-def]
    d = plan_json(cli, "--model", "llama-3-8b", "--hardware", "h100")
    assert d["request"]["price"] is None
