"""Issue 12, the OpenAI surface: /tokenize, /detokenize, /version, the OpenAPI schema, vLLM's
metric names, the Grafana dashboard, and the new sampling fields through the server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL_NAME, LiveServer

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-kvserve.json"
PROMQL_FUNCS = {"rate", "sum", "by", "le", "histogram_quantile", "clamp_min", "irate", "avg", "max", "min",
                "increase", "without", "on", "label_values", "model_name"}


def exported_names(live: LiveServer) -> set[str]:
    text = httpx.get(live.url + "/metrics", timeout=30).text
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_tokenize_and_detokenize_round_trip(live: LiveServer) -> None:
    tok = live.engine.engine.tokenizer
    r = httpx.post(live.url + "/tokenize", json={"model": MODEL_NAME, "prompt": "hello world",
                                                  "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("hello world", add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == live.engine.engine.max_model_len
    assert len(body["token_strs"]) == body["count"]
    back = httpx.post(live.url + "/detokenize", json={"tokens": body["tokens"]}, timeout=30).json()
    assert back["prompt"] == tok.decode(body["tokens"])


def test_tokenize_chat_matches_what_chat_completions_sends(live: LiveServer) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    r = httpx.post(live.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    chat = httpx.post(live.v1 + "/chat/completions", json={"model": MODEL_NAME, "messages": messages, "max_tokens": 1,
                                                            "return_token_ids": True}, timeout=60).json()
    assert r["tokens"] == chat["prompt_token_ids"] and r["count"] == chat["usage"]["prompt_tokens"]


def test_tokenize_errors_are_openai_shaped(live: LiveServer) -> None:
    r = httpx.post(live.url + "/detokenize", json={"tokens": [10**7]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(live.url + "/tokenize", json={"prompt": 5}, timeout=30)
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.post(live.url + "/tokenize", json={"prompt": "x", "model": "gpt-4"}, timeout=30).status_code == 404


def test_version(live: LiveServer) -> None:
    r = httpx.get(live.url + "/version", timeout=30)
    assert r.status_code == 200 and isinstance(r.json()["version"], str) and r.json()["version"]


def test_openapi_declares_every_request_body(live: LiveServer) -> None:
    spec = httpx.get(live.url + "/openapi.json", timeout=30).json()
    posts = {path: ops["post"] for path, ops in spec["paths"].items() if "post" in ops}
    assert set(posts) >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    for path, op in posts.items():
        assert op["requestBody"]["content"]["application/json"]["schema"], path
        assert "400" in op["responses"] and "422" not in op["responses"], path
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "min_tokens" in chat and "functions" not in chat  # refused fields are not advertised


def test_validation_errors_are_400_not_422(live: LiveServer) -> None:
    r = httpx.post(live.v1 + "/chat/completions", json={"model": MODEL_NAME, "messages": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_vllm_metric_names_beside_ours(live: LiveServer) -> None:
    httpx.post(live.v1 + "/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}, timeout=60)
    names = exported_names(live)
    for name in ("vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total"):
        assert name in names, name
    text = httpx.get(live.url + "/metrics", timeout=30).text
    values = {(s.name): s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if not s.labels.get("le")}
    assert values["vllm:kv_cache_usage_perc"] == values["kvserve:kv_cache_usage_ratio"]
    assert values["vllm:prefix_cache_hits_total"] == values["kvserve:prefix_cache_hits_total"]


def test_every_grafana_expression_names_an_exported_metric(live: LiveServer) -> None:
    httpx.post(live.v1 + "/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}, timeout=60)
    names = exported_names(live)
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    titles = {p["title"] for p in dash["panels"]}
    assert {"KV cache usage", "KV fragmentation", "Sequence length of running requests",
            "Prefix-cache hit rate"} <= titles
    seen = set()
    for expr in exprs:
        stripped = re.sub(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"', "", expr)
        for ident in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", stripped):
            if ident in PROMQL_FUNCS or ident.replace(".", "").isdigit():
                continue
            assert ident in names, f"{ident} (in {expr!r}) is not exported"
            seen.add(ident)
    assert {"kvserve:kv_cache_usage_ratio", "kvserve:kv_fragmentation_ratio", "kvserve:running_seq_len_avg",
            "kvserve:prefix_cache_hits_total"} <= seen


@pytest.mark.parametrize("extra", [{"logit_bias": {"100": 100.0}}, {"allowed_token_ids": [100]}])
def test_logit_bias_and_allowed_token_ids_force_the_token(live: LiveServer, extra: dict) -> None:  # type: ignore[type-arg]
    """Hand-computed: +100 on one token (or allowing only it) makes greedy pick it every time."""
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    r = httpx.post(live.v1 + "/completions", json=body, timeout=60)
    if r.status_code == 400:  # the engine's sampler does not apply it yet: refused, never ignored
        assert r.json()["error"]["param"] == next(iter(extra)) and "not applied" in r.json()["error"]["message"]
        return
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [100] * 4


def test_response_format_json_is_refused_or_parsed(live: LiveServer) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 64, "temperature": 0, "response_format": {"type": "json_object"},
            "messages": [{"role": "user", "content": "give me json"}]}
    r = httpx.post(live.v1 + "/chat/completions", json=body, timeout=120)
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "response_format"
        return
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    bad = {**body, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}
    assert httpx.post(live.v1 + "/chat/completions", json=bad, timeout=60).status_code == 400


def test_pinned_blocks_count_shared_blocks_once(live: LiveServer) -> None:
    """Defect 9: sessions that share a prefix pin its blocks once, never more than are used."""
    long = " ".join(["shared prefix words"] * 12)
    sids = [f"pin-share-{i}" for i in range(3)]
    for sid in sids:
        r = httpx.post(live.v1 + "/chat/completions", timeout=60, json={
            "model": MODEL_NAME, "max_tokens": 2, "temperature": 0, "session_id": sid,
            "messages": [{"role": "user", "content": long}]})
        assert r.status_code == 200, r.text
    m = {name: v for (name, labels), v in live.metrics().items() if not labels}
    pinned, used = m["kvserve:kv_blocks_pinned"], m["kvserve:kv_blocks_used"]
    # every session's own count, summed (other tests' sessions included: the server is shared)
    per_session = sum(s["pinned_blocks"] for s in httpx.get(live.v1 + "/sessions").json()["data"])
    assert 0 < pinned <= used
    assert pinned < per_session  # the shared prompt blocks are counted once, not once per session
    for sid in sids:
        httpx.delete(live.v1 + f"/sessions/{sid}")
