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


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_waited_for(tmp_path, monkeypatch):
    import os
    import threading
    import time

    stale = tmp_path / "old"
    stale.mkdir()
    (stale / "lock").write_text("")
    old = time.time() - native.STALE_LOCK_S - 5
    os.utime(stale / "lock", (old, old))
    native._wait_for_lock(stale)
    assert not (stale / "lock").exists()  # torch would have waited on it for ever
    monkeypatch.setattr(native, "LOCK_POLL_S", 0.02)
    live = tmp_path / "building"
    live.mkdir()
    (live / "lock").write_text("")  # another process is building right now, done in 0.2 s
    done = threading.Timer(0.2, (live / "lock").unlink)
    done.start()
    t0 = time.monotonic()
    native._wait_for_lock(live)
    assert time.monotonic() - t0 >= 0.15 and not (live / "lock").exists()
    done.join()
    monkeypatch.setattr(native, "STALE_LOCK_S", 0.3)  # a fresh lock whose builder died: bounded wait
    (live / "lock").write_text("")
    t0 = time.monotonic()
    native._wait_for_lock(live)
    assert 0.25 <= time.monotonic() - t0 < 5 and not (live / "lock").exists()
    native._wait_for_lock(tmp_path / "nothing-here")
