"""kvserve.native never raises on a missing toolchain: it says why and callers fall back."""

from __future__ import annotations

from kvserve import native


def _fresh(monkeypatch):
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setattr(native, "_why", {})


def test_switched_off_returns_none_with_reason(monkeypatch):
    _fresh(monkeypatch)
    monkeypatch.setenv("KVSERVE_NATIVE", "0")
    assert native.load_extension("kvserve_x", ["missing.cpp"]) is None
    assert native.unavailable_reason("kvserve_x") == "KVSERVE_NATIVE=0"


def test_no_compiler_returns_none_with_reason(monkeypatch):
    _fresh(monkeypatch)
    monkeypatch.delenv("KVSERVE_NATIVE", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda _name: None)
    assert native.load_extension("kvserve_y", ["missing.cpp"]) is None
    assert "compiler" in native.unavailable_reason("kvserve_y")


def test_a_failed_build_is_a_reason_not_an_exception_and_is_tried_once(monkeypatch, tmp_path):
    _fresh(monkeypatch)
    monkeypatch.delenv("KVSERVE_NATIVE", raising=False)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    calls = []

    def boom(**kw):
        calls.append(kw["name"])
        raise RuntimeError("Error building extension 'kvserve_z'")

    import torch.utils.cpp_extension as ce
    monkeypatch.setattr(ce, "load", boom)
    monkeypatch.setattr(native, "CSRC", tmp_path)
    (tmp_path / "z.cpp").write_text("int main;")
    assert native.load_extension("kvserve_z", ["z.cpp"]) is None
    assert native.load_extension("kvserve_z", ["z.cpp"]) is None
    assert calls == ["kvserve_z"]
    assert native.unavailable_reason("kvserve_z").startswith("build failed")


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert native.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("KVSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert native.cache_dir() == tmp_path / "x" / "kvserve"


def test_a_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_is_kept(tmp_path):
    import os
    import time

    stale = tmp_path / "old"
    stale.mkdir()
    (stale / "lock").write_text("")
    old = time.time() - native.STALE_LOCK_S - 5
    os.utime(stale / "lock", (old, old))
    native._clear_stale_lock(stale)
    assert not (stale / "lock").exists()  # torch would have waited on it for ever
    fresh = tmp_path / "building"
    fresh.mkdir()
    (fresh / "lock").write_text("")  # another process is building right now
    native._clear_stale_lock(fresh)
    assert (fresh / "lock").exists()
    native._clear_stale_lock(tmp_path / "nothing-here")
