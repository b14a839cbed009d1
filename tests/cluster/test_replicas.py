"""Two replicas (Ray actors) behind the OpenAI front end and the exact KV router.

Routing is asserted through the replica set's decision log and its index (what the replicas'
cache events told it), and the KV through ``usage.prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

from typing import Any

import httpx

from kvserve.cluster.replica_set import ReplicaSet
from kvserve.sampling_params import SamplingParams
from kvserve.server.tenants import DEFAULT_TENANT, engine_session_id, prefix_cache_salt
from tests.cluster.conftest import BLOCK_SIZE
from tests.server.conftest import LiveServer

GREEDY = {"temperature": 0, "max_tokens": 3}
SALT = prefix_cache_salt(DEFAULT_TENANT, None, False)  # what the front end gives a keyless caller


def post(srv: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(srv.v1 + path, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def pinned(rs: ReplicaSet, ids: list[int], replica: str) -> Any:
    """Run a prompt on one replica, bypassing the router (a warm-up)."""
    async def go() -> Any:
        stream = await rs.add_request(ids, SamplingParams(max_tokens=1, temperature=0), cache_salt=SALT,
                                      replica=replica)
        return await stream.result()
    return rs.run_blocking(go())


def last_decision(rs: ReplicaSet) -> Any:
    return rs.decision_log[-1].decision


def test_a_session_sticks_to_its_replica_and_reuses_its_kv(cluster: Any) -> None:
    rs, srv = cluster
    replicas, cached = set(), []
    for turn in range(3):
        out = post(srv, "/chat/completions", {"messages": [{"role": "user", "content": f"turn {turn} hello"}],
                                              "session_id": "stick", **GREEDY})
        replicas.add(rs.owners[engine_session_id(DEFAULT_TENANT, "stick")])
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert out["session_id"] == "stick"
    assert len(replicas) == 1
    assert [d.decision.reason for d in rs.decision_log[-2:]] == ["sticky", "sticky"]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]


def test_a_shared_system_prompt_routes_to_the_replica_that_holds_it(cluster: Any) -> None:
    rs, srv = cluster
    system = list(range(100, 140))  # 10 full blocks
    pinned(rs, system + [7, 8, 9], "r1")
    out = post(srv, "/completions", {"prompt": system + [11, 12, 13], **GREEDY})
    d = last_decision(rs)
    assert (d.replica, d.reason) == ("r1", "prefix")
    assert d.matched_tiers == ("pool",) * (len(system) // BLOCK_SIZE)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(system)


def test_an_evicted_prefix_stops_attracting_requests(cluster: Any) -> None:
    rs, srv = cluster
    prefix = list(range(300, 340))
    pinned(rs, prefix + [1], "r1")
    rs.run_blocking(rs.refresh())
    hashes = rs.prompt_hashes(prefix, SALT)
    assert len(rs.index.prefix("r1", hashes)) == len(prefix) // BLOCK_SIZE
    for i in range(4):  # 4 x 200 tokens through a 64-block (256-token) pool: the prefix is reused
        pinned(rs, [1000 + 7 * i + j % 500 for j in range(200)], "r1")
    rs.run_blocking(rs.refresh())
    assert rs.index.prefix("r1", hashes) == ()  # the replica's BlockRemoved events reached the index
    post(srv, "/completions", {"prompt": prefix + [2], **GREEDY})
    assert last_decision(rs).reason == "least_loaded"


def test_streaming_and_per_replica_metrics(cluster: Any) -> None:
    rs, srv = cluster
    with httpx.stream("POST", srv.v1 + "/completions", timeout=60,
                      json={"model": "tiny", "prompt": "count", "stream": True, **GREEDY}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2
    m = srv.metrics()
    assert m[("kvserve:replica_up", (("replica", "r0"),))] == 1.0
    assert m[("kvserve:replica_up", (("replica", "r1"),))] == 1.0
    served = sum(m[("kvserve:replica_requests_total", (("replica", r),))] for r in ("r0", "r1"))
    assert served >= 5
    assert m[("kvserve:router_decisions_total", (("reason", "sticky"),))] >= 2
    assert m[("kvserve:kv_blocks_total", ())] == 128  # the cluster's snapshot adds both pools
    reported = rs.info.kernel_choices  # what the replicas' runners chose, shown in the front end's /metrics
    assert reported
    for c in reported:
        assert m[("kvserve:kernel_choice", (("band", c.band), ("choice", c.choice), ("role", c.role),
                                            ("source", c.source)))] == 1.0
    health = httpx.get(srv.url + "/health", timeout=10)
    assert health.json() == {"status": "ok"}


def test_a_restarted_router_rebuilds_its_index_from_the_replicas(cluster: Any) -> None:
    rs, srv = cluster
    post(srv, "/completions", {"prompt": list(range(500, 532)), **GREEDY})
    rs.run_blocking(rs.refresh())
    before = {r: rs.index.held(r) for r in rs.up()}
    assert any(before.values())
    rs.restart_router()
    assert len(rs.index) == 0
    rs.run_blocking(rs.refresh())
    assert {r: rs.index.held(r) for r in rs.up()} == before
    sid = engine_session_id(DEFAULT_TENANT, "stick")
    owner = rs.owners[sid]
    post(srv, "/chat/completions", {"messages": [{"role": "user", "content": "after"}], "session_id": "stick",
                                    **GREEDY})
    assert (last_decision(rs).replica, last_decision(rs).reason) == (owner, "sticky")
