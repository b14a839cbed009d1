"""Schemathesis against the server's complete OpenAPI schema: zero 5xx, and every response
conforms to what the schema declares (status codes, content types, bodies, headers).

Bounded so it runs in well under a minute on two slow cores: a handful of examples per
operation, and generated bodies get ``n`` and ``max_tokens`` clamped (a schema-valid
``max_tokens=10**9`` is a fast 400 anyway, but one of 60 would spend the test's time generating).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.conftest import LiveServer, engine_config, start_server

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]


@pytest.fixture(scope="module")
def fuzzed(tiny_model) -> Iterator[LiveServer]:  # type: ignore[no-untyped-def]
    srv = start_server(tiny_model, engine_config(tiny_model, max_model_len=64), max_n=2, max_waiting=16)
    yield srv
    srv.stop()


def _bounded(body: Any) -> Any:
    if isinstance(body, dict):
        for key, cap in (("n", 2), ("max_tokens", 4), ("max_completion_tokens", 4), ("top_logprobs", 2),
                         ("logprobs", 2)):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                body[key] = cap
        body.pop("stream", None) if body.get("stream") is True and body.get("n", 1) > 1 else None
    return body


def test_api_conforms_and_never_5xx(fuzzed: LiveServer) -> None:
    schema = schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    seen: list[str] = []
    calls: list[int] = []
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=10, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def run(case: Any) -> None:
            case.body = _bounded(case.body)
            case.call_and_validate(checks=CHECKS, timeout=60)
            calls.append(1)

        run()
        seen.append(op.label)
        assert fuzzed.engine.alive, op.label
    assert any("chat/completions" in label for label in seen)
    assert len(calls) >= 5 * len(operations)
