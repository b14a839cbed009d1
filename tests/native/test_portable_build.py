"""Native builds for another CPU (``KVSERVE_NATIVE_MARCH``): the target is part of every build's
and cached timing's key, a bad target is a reason and not an exception, and the kernels that an
AVX2-only CPU and a plain x86-64 CPU get build here and pass their tests (a session on an
AVX2-only EPYC would otherwise be the first to compile those paths: an AVX-512 test assumption
once went unseen that way)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve import native
from kvserve.bench.machine import cpu_info

ROOT = Path(__file__).resolve().parents[2]
HAS_CXX = (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")) is not None
# the tests that cover every native kernel and its fallbacks, and the model against transformers
SUBSET = ["tests/native", "tests/model/test_tiled_gemm.py", "tests/model/test_paged_attention.py",
          "tests/engine/test_decode_stack.py", "tests/model/test_model_parity.py"]
# every extension built, two at a time (the two cores), before the tests load them
BUILD = """
import sys
from kvserve import native
from kvserve.native import extensions
failed = [name for name, ok in extensions.prebuild().items() if not ok]
if failed:
    sys.exit(f"{failed}: {native._why}")
"""

def test_the_target_is_this_cpu_unless_the_environment_names_another(monkeypatch):
    monkeypatch.delenv("KVSERVE_NATIVE_MARCH", raising=False)
    assert native.march() == "native"
    monkeypatch.setenv("KVSERVE_NATIVE_MARCH", " x86-64-v3 ")
    assert native.march() == "x86-64-v3"
    monkeypatch.setenv("KVSERVE_NATIVE_MARCH", "native -O0")
    with pytest.raises(ValueError, match="KVSERVE_NATIVE_MARCH"):
        native.march()


def test_a_bad_target_is_a_reason_not_an_exception(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setattr(native, "_why", {})
    monkeypatch.delenv("KVSERVE_NATIVE", raising=False)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVSERVE_NATIVE_MARCH", "$(reboot)")
    import torch.utils.cpp_extension as ce

    monkeypatch.setattr(ce, "load", lambda **kw: pytest.fail("built with a bad target"))
    assert native.load_extension("kvserve_bad_target", ["argmax.cpp"]) is None
    assert "KVSERVE_NATIVE_MARCH" in native.unavailable_reason("kvserve_bad_target")


def test_benchmarks_record_the_target_they_ran(monkeypatch):
    monkeypatch.setenv("KVSERVE_NATIVE_MARCH", "x86-64-v3")
    assert cpu_info()["native_march"] == "x86-64-v3"
    monkeypatch.setenv("KVSERVE_NATIVE_MARCH", "native;rm")
    assert cpu_info()["native_march"].startswith("invalid (")


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
def test_target_features_are_what_the_compiler_defines_for_the_target(monkeypatch):
    monkeypatch.setenv("KVSERVE_NATIVE_MARCH", "x86-64-v3")
    v3 = native.target_features()
    assert {"avx2", "fma", "f16c"} <= v3 and "avx512f" not in v3
    monkeypatch.setenv("KVSERVE_NATIVE_MARCH", "x86-64")
    plain = native.target_features()
    assert "sse2" in plain and "avx2" not in plain
    monkeypatch.delenv("KVSERVE_NATIVE_MARCH")
    here = native.target_features()
    flags = cpu_info()["flags"]
    for feature, flag in (("avx2", "avx2"), ("avx512f", "avx512f"), ("avx512bf16", "avx512_bf16")):
        assert (feature in here) == (flag in flags), feature  # type: ignore[operator]


def test_every_cache_of_timings_is_keyed_by_the_target(monkeypatch):
    from kvserve.model import attention_choice, gemm_plan
    from kvserve.model.gemm_tune import RoleShape

    roles = (RoleShape("mlp", ((9728, 896), (896, 4864)), 24),)
    keys = []
    for target in (None, "x86-64-v3"):
        if target is None:
            monkeypatch.delenv("KVSERVE_NATIVE_MARCH", raising=False)
        else:
            monkeypatch.setenv("KVSERVE_NATIVE_MARCH", target)
        keys.append((gemm_plan._key(roles, torch.bfloat16, ("torch",)),
                     attention_choice.cache_key(14, 2, 64, 16, torch.bfloat16)))
    assert keys[0][0] != keys[1][0] and keys[0][1] != keys[1][1]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
@pytest.mark.skipif(bool(os.environ.get("KVSERVE_NATIVE_MARCH")), reason="already a run for another target")
@pytest.mark.parametrize("target", ["x86-64-v3", "x86-64"])
def test_the_kernels_of_a_cpu_without_avx512_build_and_pass_their_tests(target: str) -> None:
    """x86-64-v3: AVX2 + FMA + F16C (the tiled AVX2 GEMM and attention paths, no bf16-dot or
    int8-dot); x86-64: none of them (the scalar and torch paths)."""
    env = {**os.environ, "KVSERVE_NATIVE_MARCH": target, "PYTHONPATH": str(ROOT)}
    build = subprocess.run([sys.executable, "-c", BUILD], env=env, cwd=ROOT, check=False,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-2000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                          "--ignore", "tests/native/test_portable_build.py", *SUBSET],
                         check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.strip().splitlines()[-1], run.stdout[-500:]  # and ran some


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
def test_the_target_is_shown_among_the_kernel_choices(monkeypatch):
    from kvserve.native.choices import choices
    from kvserve.planner.kernels import target_rows

    monkeypatch.setenv("KVSERVE_NATIVE_MARCH", "x86-64-v3")
    native.record_target()
    try:
        (row,) = target_rows()
        assert row[:2] == ("native_target", "all") and row[3] == "forced"
        assert row[2].startswith("x86-64-v3: ") and "avx2" in row[2].split() and "avx512f" not in row[2]
    finally:
        monkeypatch.delenv("KVSERVE_NATIVE_MARCH")
        native.record_target()  # back to this process's own target
    (mine,) = [c for c in choices() if c.role == "native_target"]
    assert mine.choice.startswith("native: ") and mine.source == "default"
