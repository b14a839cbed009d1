"""A prefill/decode split (1 + 1 replicas): the prompt's KV is computed on the prefill replica and
sent to the decode replica by ``SendBlocks``/``ReceiveBlocks`` (over the direct TCP channel and
over Ray's object store), which finds it in its pool and decodes: the same greedy tokens as one
engine. A transfer that cannot finish in time, or whose channel is dead, falls back to computing
on the decode replica within the timeout."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve.cluster.launch import launch_replica_set
from kvserve.cluster.router import RouterConfig
from kvserve.engine.engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from tests.cluster.conftest import RAY, cluster_engine_config
from tests.server.conftest import start_server

PROMPT = list(range(200, 241))  # 41 tokens: 10 full blocks


@pytest.fixture(scope="module")
def pd(cluster_model: Path) -> Iterator[Any]:
    cfg = cluster_engine_config(cluster_model)  # no tier: blocks go pool to pool
    rs = launch_replica_set(cfg, dataclasses.replace(RAY, prefill_replicas=1), RouterConfig())
    srv = start_server(cluster_model, engine=rs, max_waiting=None)
    yield rs, srv
    srv.stop()


def complete(srv: Any, prompt: list[int]) -> dict[str, Any]:
    r = httpx.post(srv.v1 + "/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def reference(cluster_model: Path, prompt: list[int]) -> list[int]:
    one = LLMEngine(cluster_engine_config(cluster_model))  # one engine, in this process
    one.add_request(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), request_id="ref")
    return list([o for o in one.run_until_done() if o.request_id == "ref"][-1].outputs[0].token_ids)


@pytest.mark.parametrize("channel", ["direct", "object_store"])
def test_pd_gives_the_tokens_of_one_engine_and_the_ledger_shows_the_transfer(pd: Any, cluster_model: Path,
                                                                              channel: str) -> None:
    rs, srv = pd
    prompt = [t + {"direct": 1000, "object_store": 2000}[channel] for t in PROMPT]  # nothing held before
    want = reference(cluster_model, prompt)
    before = dataclasses.replace(rs.transfers)
    rs.pd_channel = channel
    try:
        out = complete(srv, prompt)
    finally:
        rs.pd_channel = "direct"
    assert out["choices"][0]["token_ids"] == want
    # the decode replica is chosen first, then the prefill replica is given the prompt
    assert [(d.decision.replica, d.decision.reason) for d in rs.decision_log[-2:]] == [("d0", "least_loaded"),
                                                                                      ("p0", "pinned")]
    led = rs.transfers
    assert (led.transfers - before.transfers, led.blocks - before.blocks, led.fallbacks - before.fallbacks) == \
        (1, 10, 0)
    assert led.bytes > before.bytes
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 40  # found in the decode replica's pool
    assert out["usage"]["kv"]["hit_tokens"]["pool"] == 40
    m = srv.metrics()
    assert m[("kvserve:pd_transfer_bytes_total", ())] == led.bytes


def test_a_dead_channel_falls_back_to_recompute_within_the_timeout(pd: Any, cluster_model: Path) -> None:
    rs, srv = pd
    prompt = list(range(400, 441))
    fallbacks = rs.transfers.fallbacks
    address = rs.peer_addresses["d0"]
    rs.peer_addresses["d0"] = "tcp://127.0.0.1:1"  # nothing listens there: the send is refused
    t0 = time.monotonic()
    try:
        out = complete(srv, prompt)
    finally:
        rs.peer_addresses["d0"] = address
    assert time.monotonic() - t0 < 30  # a tiny model's prefill, a refused connect, a recompute: no 300 s wait
    assert rs.transfers.fallbacks == fallbacks + 1
    assert out["choices"][0]["token_ids"] == reference(cluster_model, prompt)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_transfer_that_cannot_finish_in_time_falls_back_to_recompute(pd: Any) -> None:
    rs, srv = pd
    prompt = list(range(600, 641))
    done, fallbacks, skipped = rs.transfers.transfers, rs.transfers.fallbacks, rs.transfers.skipped
    rs.transfer_timeout_s = 0.0  # no transfer can make it
    try:
        slow = complete(srv, prompt)
    finally:
        rs.transfer_timeout_s = 1.0
    # the decode replica went on without the blocks (it gave the held blocks back) and served
    # the request
    assert (rs.transfers.fallbacks, rs.transfers.transfers) == (fallbacks + 1, done)
    assert len(slow["choices"][0]["token_ids"]) == 6
    again = complete(srv, [*prompt[:40], 7])  # the decode replica now holds the prefix: nothing to ship
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
    assert rs.transfers.skipped == skipped + 1
