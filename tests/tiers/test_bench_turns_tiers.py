"""``kvserve bench turns`` with the tier modes, on the tiny model: session-tiers, session (the
same small pool, recomputing) and session-big side by side, the ratios in the summary, and the
restart figures (a new engine on the same disk directory continues every conversation with its
history loaded from the tiers)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from kvserve.bench.turns import TurnsConfig, run
from kvserve.cli import app
from tests.engine.conftest import write_tiny_llama


def test_tier_modes_side_by_side_and_the_restart(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    cfg = TurnsConfig(model=str(model), modes=("session-tiers", "session", "session-big"), turns=3,
                      user_tokens=24, new_tokens=4, conversations=4, dtype="float32",
                      kv_cache_memory="96KiB", kv_host_memory="16MiB", big_kv_cache_memory="4MiB")
    doc = run(cfg)
    s = doc["summary"]["session-tiers"]
    assert set(s["tiers_over_big_per_turn"]) == {2, 3} and s["recompute_over_tiers_median"] > 0
    tiers = doc["modes"]["session-tiers"]["turns"]
    small = doc["modes"]["session"]["turns"]
    later = [r for r in tiers if r["turn"] > 1]
    assert sum(r["cached_tokens"] for r in later) > sum(r["cached_tokens"] for r in small if r["turn"] > 1)
    r = doc["restart"]
    assert r["disk_blocks"] > 0 and r["next_turn_cached_fraction"] > 0.5  # history loaded after the restart


def test_the_cli_takes_the_tier_options(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m")
    res = CliRunner().invoke(app, ["bench", "turns", "--model", str(model), "--modes", "session-tiers",
                                   "--turns", "2", "--user-tokens", "16", "--new-tokens", "2", "--conversations", "2",
                                   "--dtype", "float32", "--kv-cache-memory", "64KiB", "--kv-host-memory", "8MiB",
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "restart on the same disk directory" in res.output and (tmp_path / "out" / "turns.json").exists()
