"""A local Ray (2 CPUs, a small object store, no dashboard) with 2 replicas of a tiny random-weight
Llama behind a real uvicorn server. One Ray session per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve.cluster.launch import ClusterConfig, launch_replica_set
from kvserve.cluster.replica_set import ReplicaSet
from kvserve.cluster.router import RouterConfig
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from tests.engine.conftest import write_tiny_llama
from tests.server.conftest import LiveServer, start_server

BLOCK_SIZE = 4
RAY = ClusterConfig(replicas=2, num_cpus=2, object_store_bytes=80 * 2**20, cpus_per_replica=0.5)


def cluster_engine_config(model: Path, num_blocks: int = 64, **cache: Any) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float32", device="cpu", seed=0, num_threads=1,
                        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=num_blocks, **cache),
                        scheduler=SchedulerConfig(max_model_len=256))


def chat(srv: LiveServer, sid: str, content: str, **extra: Any) -> dict[str, Any]:
    """One greedy 4-token chat turn of session ``sid`` through the front end."""
    r = httpx.post(srv.v1 + "/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": content}], "session_id": sid,
        "temperature": 0, "max_tokens": 4, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def text(reply: dict[str, Any]) -> str:
    return reply["choices"][0]["message"]["content"]  # type: ignore[no-any-return]


def start_cluster(model: Path, cfg: EngineConfig | None = None, router: str = "kv") -> tuple[ReplicaSet, LiveServer]:
    rs = launch_replica_set(cfg or cluster_engine_config(model), RAY, RouterConfig(policy=router))
    return rs, start_server(model, engine=rs, max_waiting=None)


@pytest.fixture(scope="module")
def cluster_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("cluster-tiny-llama"))


@pytest.fixture(scope="module")
def cluster(cluster_model: Path) -> Iterator[tuple[ReplicaSet, LiveServer]]:
    rs, srv = start_cluster(cluster_model)
    yield rs, srv
    srv.stop()  # the app's lifespan shuts the replica set (and the Ray it started) down
