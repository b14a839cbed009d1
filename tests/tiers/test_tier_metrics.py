"""Per-tier metrics through the real server: blocks and bytes held, saves, loads, up; and the
response's ``usage.kv`` ledger names the tier a reused prefix came from."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx

from tests.engine.conftest import write_tiny_llama
from tests.server.conftest import engine_config, start_server


def test_tier_metrics_and_the_usage_ledger(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    cfg = engine_config(model, max_model_len=96)
    cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, num_blocks_override=24, kv_host_memory=8 << 20))
    srv = start_server(model, cfg, max_waiting=None)
    try:
        def complete(ids: list[int]) -> dict:  # type: ignore[type-arg]
            r = httpx.post(srv.v1 + "/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 2,
                                                          "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        a = list(range(100, 160))
        first = complete(a)
        assert first["usage"]["kv"]["hit_tokens"] == {"pool": 0, "host": 0, "disk": 0, "remote": 0}
        assert first["usage"]["kv"]["recomputed_tokens"] == 60
        for i in range(3):  # push A's blocks out of the 24-block pool
            complete(list(range(1000 + 70 * i, 1060 + 70 * i)))
        again = complete(a)
        kv = again["usage"]["kv"]
        assert kv["hit_tokens"]["host"] >= 52 and kv["hit_tokens"]["host"] + kv["hit_tokens"]["pool"] == \
            again["usage"]["prompt_tokens_details"]["cached_tokens"]
        m = srv.metrics()
        assert m[("kvserve:kv_tier_blocks", (("tier", "host"),))] >= 14
        assert m[("kvserve:kv_tier_bytes", (("tier", "host"),))] > 0
        assert m[("kvserve:kv_tier_saves_total", (("tier", "host"),))] >= 14 * 4 // 4
        assert m[("kvserve:kv_tier_loads_total", (("tier", "host"),))] >= 13
        assert m[("kvserve:kv_tier_up", (("tier", "host"),))] == 1.0
        assert m[("kvserve:kv_tier_checksum_failures_total", (("tier", "host"),))] == 0
    finally:
        srv.stop()
