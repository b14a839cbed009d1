"""Ray restarts a killed replica actor (``max_restarts``) before the router notices: the router's
next poll meets a new epoch, drops what the dead incarnation held and rebuilds that replica's
entries from the new incarnation's snapshot; the stale prefix attracts nothing, and the new
incarnation's events (numbered from 0 again) reach the index.

No HTTP server and no background poller here: the replica set serves on a loop of the test's own,
so the only polls are the router's (each routing decision refreshes first), and the restart is
seen through the epoch alone, not through a failed poll."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from kvserve.cluster.launch import launch_replica_set
from kvserve.cluster.replica_set import ReplicaSet
from kvserve.cluster.router import RouterConfig
from kvserve.sampling_params import SamplingParams
from tests.cluster.conftest import BLOCK_SIZE, RAY, cluster_engine_config

PROMPT = list(range(200, 240))       # 10 full blocks
OTHER = list(range(300, 332))        # 8 full blocks


@pytest.fixture(scope="module")
def restartable(cluster_model: Path) -> Iterator[ReplicaSet]:
    rs = launch_replica_set(cluster_engine_config(cluster_model), dataclasses.replace(RAY, max_restarts=1),
                            RouterConfig(policy="kv"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    rs.loop = loop  # serve on this loop without start(): no background poller
    yield rs
    rs.shutdown()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def run(rs: ReplicaSet, ids: list[int], replica: str | None = None) -> Any:
    async def go() -> Any:
        stream = await rs.add_request(ids, SamplingParams(max_tokens=1, temperature=0), replica=replica)
        return await stream.result()
    return rs.run_blocking(go())


def wait_restarted(handle: Any, old_pid: int, timeout_s: float = 60.0) -> int:
    """Ask the actor directly (not through the router) until a new process answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # restarting: unavailable for a moment
            pid: int = ray.get(handle.info.remote(), timeout=5).pid
            if pid != old_pid:
                return pid
        time.sleep(0.2)
    raise AssertionError("Ray did not restart the replica")


def test_a_restarted_replica_is_rebuilt_from_its_new_epoch(restartable: ReplicaSet) -> None:
    rs = restartable
    run(rs, PROMPT + [7], replica="r1")
    rs.run_blocking(rs.refresh())
    hashes = rs.prompt_hashes(PROMPT)
    assert len(rs.index.prefix("r1", hashes)) == len(PROMPT) // BLOCK_SIZE
    old_epoch, old_seq = rs.replicas["r1"].epoch, rs.index.seq["r1"]

    old_pid = rs.run_blocking(rs.kill_replica_process("r1"))
    wait_restarted(rs.replicas["r1"].handle, old_pid)
    # the router has not polled since: it still believes r1 holds the prompt
    assert rs.replicas["r1"].up and len(rs.index.prefix("r1", hashes)) == len(PROMPT) // BLOCK_SIZE

    run(rs, PROMPT + [8])  # routed: the decision's refresh meets the new epoch first
    d = rs.decision_log[-1].decision
    assert d.reason != "prefix" and d.matched_blocks == 0  # the dead incarnation's blocks attract nothing
    assert rs.replicas["r1"].epoch != old_epoch and rs.replicas["r1"].up
    assert rs.index.seq["r1"] < old_seq  # the new incarnation's numbering, from its snapshot

    run(rs, OTHER + [9], replica="r1")  # the new incarnation's own events reach the index
    rs.run_blocking(rs.refresh())
    assert len(rs.index.prefix("r1", rs.prompt_hashes(OTHER))) == len(OTHER) // BLOCK_SIZE
    if d.replica == "r2":
        assert rs.index.prefix("r1", hashes) == ()
    run(rs, PROMPT + [10])  # whoever served the prompt after the restart now holds it: it goes there
    again = rs.decision_log[-1].decision
    assert (again.replica, again.reason) == (d.replica, "prefix")
