"""Failover: a replica's process is killed mid-conversation (two replicas sharing a Redis tier).

The in-flight turn ends with a retriable 503 in the stream (no hang); the conversation's next
turn goes to the live replica, which adopts the session from Redis and loads its KV from there:
the same tokens as a conversation that never failed, with ``cached_tokens`` from the remote tier."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from kvserve.cluster.replica_set import ReplicaSet
from kvserve.server.tenants import DEFAULT_TENANT, engine_session_id
from tests.cluster.conftest import chat, cluster_engine_config, start_cluster, text
from tests.server.conftest import LiveServer
from tests.tiers.conftest import RedisServer

TURNS = ["hello there", "tell me more", "and then?"]


@pytest.fixture(scope="module")
def redis_cluster(cluster_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail("redis-server is not installed; .ci/run installs Debian's redis-server")
        pytest.skip("redis-server is not installed: the shared tier of the failover test needs a real Redis")
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    redis.start()
    rs, srv = start_cluster(cluster_model, cluster_engine_config(cluster_model, 128, kv_remote=redis.url))
    yield rs, srv
    srv.stop()
    redis.stop()



def test_killing_a_replica_mid_conversation_loses_no_conversation(redis_cluster: tuple[ReplicaSet, LiveServer]) -> None:
    rs, srv = redis_cluster
    # the same conversation, no failure (another salt: its KV can never serve the one under test)
    reference = [text(chat(srv, "reference", t, cache_salt="reference")) for t in TURNS]
    for t in TURNS[:2]:
        chat(srv, "conv", t)
    owner = rs.owners[engine_session_id(DEFAULT_TENANT, "conv")]
    pid = ray.get(rs.replicas[owner].handle.info.remote()).pid

    events: list[dict[str, Any]] = []
    with httpx.stream("POST", srv.v1 + "/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "a long answer please"}],
            "session_id": "conv", "temperature": 0, "max_tokens": 150, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 1:  # the turn is running on the owner: freeze it, then kill it
                os.kill(pid, signal.SIGSTOP)
                os.kill(pid, signal.SIGKILL)
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and "retry" in errors[0]["message"]
    assert errors[0]["type"] == "service_unavailable"  # a 503: the client may retry

    after = chat(srv, "conv", TURNS[2])
    assert text(after) == reference[2]
    assert rs.owners[engine_session_id(DEFAULT_TENANT, "conv")] != owner
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert after["usage"]["kv"]["hit_tokens"]["remote"] > 0
    m = srv.metrics()
    assert m[("kvserve:replica_up", (("replica", owner),))] == 0.0
    health = httpx.get(srv.url + "/health", timeout=10)
    assert health.status_code == 200  # one replica is still serving
