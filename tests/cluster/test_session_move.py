"""A live session leaves its overloaded replica for a less busy one, with its KV: the router
moves the session's record and sends its history's blocks (``SendBlocks``/``ReceiveBlocks``),
the old replica forgets it, and the turn gets the tokens an undisturbed conversation gets, with
its history found in the new replica's pool."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from kvserve.cluster.launch import launch_replica_set
from kvserve.cluster.router import RouterConfig
from kvserve.sampling_params import SamplingParams
from kvserve.server.tenants import DEFAULT_TENANT, engine_session_id
from tests.cluster.conftest import RAY, chat, cluster_engine_config, text
from tests.server.conftest import start_server

TURNS = ["hello there my friend", "tell me more about it", "and then?"]


@pytest.fixture(scope="module")
def busy_cluster(cluster_model: Path) -> Iterator[Any]:
    cfg = cluster_engine_config(cluster_model, 128)
    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, max_num_seqs=1))
    rs = launch_replica_set(cfg, RAY, RouterConfig(overload_waiting=2))
    srv = start_server(cluster_model, engine=rs, max_waiting=None)
    yield rs, srv
    srv.stop()


def occupy(rs: Any, replica: str, n: int) -> list[Any]:
    """``n`` long requests on ``replica`` (one runs, the rest wait: max_num_seqs is 1)."""
    async def go() -> list[Any]:
        return [await rs.add_request(list(range(10, 20)), SamplingParams(max_tokens=240, temperature=0,
                                                                         ignore_eos=True), replica=replica)
                for _ in range(n)]
    return rs.run_blocking(go())  # type: ignore[no-any-return]


def test_a_session_moves_off_an_overloaded_replica_with_its_kv(busy_cluster: Any) -> None:
    rs, srv = busy_cluster
    reference = [text(chat(srv, "reference", t, cache_salt="reference")) for t in TURNS]
    first = chat(srv, "conv", TURNS[0])
    sid = engine_session_id(DEFAULT_TENANT, "conv")
    owner = rs.owners[sid]
    streams = occupy(rs, owner, 4)  # 1 running + 3 waiting >= overload_waiting
    moved_before, blocks_before = rs.transfers.sessions_moved, rs.transfers.blocks
    second = chat(srv, "conv", TURNS[1])
    decision = rs.decision_log[-1].decision
    assert decision.reason == "moved" and decision.replica != owner
    assert rs.owners[sid] == decision.replica
    assert rs.transfers.sessions_moved == moved_before + 1
    history = first["usage"]["prompt_tokens"] + 4
    assert rs.transfers.blocks - blocks_before == (history - 1) // 4  # every full block of the history
    assert text(first) == reference[0] and text(second) == reference[1]
    assert second["usage"]["kv"]["hit_tokens"]["pool"] >= (history - 1) // 4 * 4  # found, not recomputed
    # the old replica forgot it; the new one serves the next turn (sticky)
    assert ray.get(rs.replicas[owner].handle.session.remote(sid)) is None
    for s in streams:
        rs.abort(s.request_id)
    third = chat(srv, "conv", TURNS[2])
    assert text(third) == reference[2]
    assert rs.decision_log[-1].decision == dataclasses.replace(decision, reason="sticky")
    m = srv.metrics()
    assert m[("kvserve:router_decisions_total", (("reason", "moved"),))] >= 1


def test_a_busy_owner_with_no_less_busy_peer_keeps_its_session(busy_cluster: Any) -> None:
    rs, srv = busy_cluster
    chat(srv, "stay", TURNS[0])
    owner = rs.owners[engine_session_id(DEFAULT_TENANT, "stay")]
    others = [n for n in rs.replicas if n != owner]
    streams = occupy(rs, owner, 3) + [s for n in others for s in occupy(rs, n, 5)]  # the other is busier
    moved = rs.transfers.sessions_moved
    chat(srv, "stay", TURNS[1])
    assert rs.decision_log[-1].decision.reason == "sticky"
    assert rs.transfers.sessions_moved == moved
    for s in streams:
        rs.abort(s.request_id)
