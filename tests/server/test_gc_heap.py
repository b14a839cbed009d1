"""The serving process freezes its start-up heap (kvserve.engine.gc_heap), so no full garbage
collection walks the engine's objects while requests stream."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvserve.engine.gc_heap import freeze_startup_heap


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_freezing_takes_the_live_heap_out_of_collections_and_not_what_comes_after() -> None:
    before = {"kept": [1, 2, 3]}
    assert _tracked(before)
    try:
        frozen = freeze_startup_heap()
        assert frozen > 0 and gc.get_freeze_count() > 0  # (frozen objects still die by refcount: no equality)
        assert not _tracked(before)  # in the permanent generation: no collection walks it
        after = {"new": [4]}
        assert _tracked(after)  # objects made afterwards are collected as usual
    finally:
        gc.unfreeze()
    assert _tracked(before) and gc.get_freeze_count() == 0


def test_serve_freezes_the_heap_after_building_the_engine(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    from kvserve.cli import app

    seen: dict[str, int] = {}

    def run(app_: object, **_: object) -> None:  # instead of serving: what the heap looks like then
        seen["frozen"] = gc.get_freeze_count()
        seen["engine_objects_tracked"] = sum(1 for o in gc.get_objects() if type(o).__name__ == "LLMEngine")

    monkeypatch.setattr(uvicorn, "run", run)
    assert gc.get_freeze_count() == 0
    try:
        result = CliRunner().invoke(app, ["serve", "--model", str(tiny_model), "--dtype", "float32",
                                          "--kv-cache-memory", "4MiB", "--port", "1"])
        assert result.exit_code == 0, result.output
    finally:
        gc.unfreeze()
    assert seen["frozen"] > 0
    assert seen["engine_objects_tracked"] == 0  # the engine was built before the freeze: frozen with it
