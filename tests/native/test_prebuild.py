"""kvserve.native.extensions: the registry names every kernel source, builds of different
extensions run at once while one name builds once, a failed build is a False and not an
exception, and loading a model on a CPU leaves no kernel for the first request to build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest

from kvserve import native
from kvserve.assets import default_model_path
from kvserve.native import extensions
from kvserve.native.extensions import Extension

ROOT = Path(__file__).resolve().parents[2]
HAS_CXX = (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")) is not None


def test_the_registry_names_every_kernel_source_and_nothing_else():
    named = {f for e in extensions.ALL for f in (*e.sources, *e.includes)}
    on_disk = {p.name for p in native.CSRC.iterdir() if p.suffix in (".cpp", ".h")}
    assert named == on_disk
    compiled = [s for e in extensions.ALL for s in e.sources]
    assert sorted(compiled) == sorted({p for p in on_disk if p.endswith(".cpp")})  # each .cpp a module
    assert len({e.name for e in extensions.ALL}) == len(extensions.ALL)


def _fake_builds(monkeypatch, build):
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setattr(native, "_why", {})
    monkeypatch.setattr(native, "_locks", {})
    monkeypatch.delenv("KVSERVE_NATIVE", raising=False)
    monkeypatch.setattr(native, "_try_build", build)


def test_different_extensions_build_at_once_and_each_name_once(monkeypatch):
    both_inside = threading.Barrier(2, timeout=20)  # broken unless two builds overlap
    calls: list[str] = []

    def build(name, sources, extra, includes):
        calls.append(name)
        both_inside.wait()
        return ModuleType(name)

    _fake_builds(monkeypatch, build)
    exts = (Extension("kvserve_a", ("a.cpp",)), Extension("kvserve_b", ("b.cpp",)))
    assert extensions.prebuild(exts, workers=2) == {"kvserve_a": True, "kvserve_b": True}
    assert sorted(calls) == ["kvserve_a", "kvserve_b"]
    first = native._built["kvserve_a"]
    assert extensions.prebuild(exts, workers=2) == {"kvserve_a": True, "kvserve_b": True}
    assert extensions.load(exts[0]) is first and len(calls) == 2  # built once, the same module after


def test_one_name_asked_for_by_two_threads_at_once_builds_once(monkeypatch):
    started = threading.Event()
    release = threading.Event()
    calls: list[str] = []

    def build(name, sources, extra, includes):
        calls.append(name)
        started.set()
        release.wait(20)
        return ModuleType(name)

    _fake_builds(monkeypatch, build)
    ext = Extension("kvserve_c", ("c.cpp",))
    got: list[ModuleType | None] = []
    threads = [threading.Thread(target=lambda: got.append(extensions.load(ext))) for _ in range(2)]
    threads[0].start()
    assert started.wait(20)
    threads[1].start()
    release.set()
    for t in threads:
        t.join(20)
    assert calls == ["kvserve_c"] and len(got) == 2 and got[0] is got[1] is not None


def test_a_failed_build_is_false_and_the_others_still_load(monkeypatch):
    def build(name, sources, extra, includes):
        if name == "kvserve_bad":
            native._why[name] = "build failed: test"
            return None
        return ModuleType(name)

    _fake_builds(monkeypatch, build)
    exts = (Extension("kvserve_bad", ("bad.cpp",)), Extension("kvserve_good", ("good.cpp",)))
    assert extensions.prebuild(exts) == {"kvserve_bad": False, "kvserve_good": True}
    assert native.unavailable_reason("kvserve_bad") == "build failed: test"


def test_switched_off_builds_nothing(monkeypatch):
    import torch.utils.cpp_extension as ce

    def build(**kw):  # pragma: no cover - must not be called
        raise AssertionError("compiled while KVSERVE_NATIVE=0")

    _fake_builds(monkeypatch, native._try_build)
    monkeypatch.setattr(ce, "load", build)
    monkeypatch.setenv("KVSERVE_NATIVE", "0")
    assert extensions.prebuild((Extension("kvserve_d", ("d.cpp",)),)) == {"kvserve_d": False}
    assert native.unavailable_reason("kvserve_d") == "KVSERVE_NATIVE=0"


LOAD_THEN_LIST = """
from kvserve import native
from kvserve.model.loader import load_model
load_model(r"{model}")
print(sorted(name for name, mod in native._built.items() if mod is not None))
"""


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
@pytest.mark.skipif(os.environ.get("KVSERVE_NATIVE", "1") == "0", reason="native kernels switched off")
def test_loading_a_model_on_a_cpu_builds_every_kernel_before_any_request():
    """Before the first step: the layer loop and the argmax are first used inside a request, and
    built lazily they took ~55 s of the first request on the 2-core EPYC (others queued behind)."""
    run = subprocess.run([sys.executable, "-c", LOAD_THEN_LIST.format(model=default_model_path())],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == str(sorted(e.name for e in extensions.ALL))
