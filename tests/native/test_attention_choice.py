"""Choosing the attention backend: forced, measured once and cached, or the torch fallback."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve import native
from kvserve.model import attention_choice
from kvserve.model.attention_backends import TorchSDPABackend
from kvserve.model.attention_native import NativePagedBackend, native_module
from kvserve.native import choices

SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": torch.float32}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVSERVE_ATTENTION_RETUNE", raising=False)
    choices.clear()
    yield
    choices.clear()


def recorded() -> dict[tuple[str, str], tuple[str, str]]:
    return {(c.role, c.band): (c.choice, c.source) for c in choices.choices()}


def test_forcing_torch_records_it():
    assert isinstance(attention_choice.select_backend("torch_sdpa", **SHAPE), TorchSDPABackend)
    assert set(recorded().values()) == {("torch_sdpa", "forced")} and len(recorded()) == len(attention_choice.ROLES) == 4


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="auto, torch_sdpa, native"):
        attention_choice.select_backend("flash", **SHAPE)


def test_without_the_extension_auto_is_the_torch_path(monkeypatch):
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setattr(native, "_why", {})
    monkeypatch.setenv("KVSERVE_NATIVE", "0")
    assert isinstance(attention_choice.select_backend("auto", **SHAPE), TorchSDPABackend)
    assert recorded()[("attention_decode", "all")] == ("torch_sdpa", "fallback")
    forced = attention_choice.select_backend("native", **SHAPE)  # still runs: the torch path inside
    assert isinstance(forced, NativePagedBackend) and forced.module is None


@pytest.mark.skipif(native_module() is None, reason="no native kernel")
def test_auto_picks_the_faster_per_role_and_caches_it(monkeypatch, tmp_path):
    calls = []

    def timer(backend, case):
        calls.append(backend.name)
        kind = {1: "decode", 64: "short", 256: "mid", 1024: "long"}[case[3].query_start_loc[1]]
        return {("native", "decode"): 1.0, ("torch_sdpa", "decode"): 2.0, ("native", "short"): 1.0,
                ("torch_sdpa", "short"): 1.2, ("native", "mid"): 3.0, ("torch_sdpa", "mid"): 1.5,
                ("native", "long"): 1.0, ("torch_sdpa", "long"): 2.0}[(backend.name, kind)]

    real = attention_choice.measure
    monkeypatch.setattr(attention_choice, "measure", lambda *a: real(*a, timer=timer))
    b = attention_choice.select_backend("auto", **SHAPE)
    assert isinstance(b, NativePagedBackend) and b.decode and b.short_prefill and not b.prefill and b.long_prefill
    assert (b.short_chunk, b.long_chunk) == (attention_choice.SHORT_CHUNK, attention_choice.LONG_CHUNK)
    path = "tiled" if native_module().tiled_available() else "scalar"  # fp32, head_dim 8: never bf16-dot
    assert recorded() == {("attention_decode", "all"): ("native", "measured"),
                          ("attention_prefill", "q<=96"): ("native", "measured"),
                          ("attention_prefill", "q<=512"): ("torch_sdpa", "measured"),
                          ("attention_prefill", "q>512"): ("native", "measured"),
                          ("attention_native", "all"): (path, "default"),
                          ("attention_native", "int8_kv"): (path, "default")}
    assert len(calls) == 8
    data = json.loads((tmp_path / attention_choice.CACHE_FILE).read_text())
    key = attention_choice.cache_key(*SHAPE.values())
    assert data[key]["attention_decode/all"] == {"torch_sdpa": 2.0, "native": 1.0}
    b2 = attention_choice.select_backend("auto", **SHAPE)   # read from the cache: no timing
    assert len(calls) == 8 and b2.decode and not b2.prefill and b2.long_prefill
    assert recorded()[("attention_decode", "all")] == ("native", "cached")
    monkeypatch.setenv("KVSERVE_ATTENTION_RETUNE", "1")
    attention_choice.select_backend("auto", **SHAPE)
    assert len(calls) == 16


@pytest.mark.skipif(native_module() is None, reason="no native kernel")
def test_a_step_the_kernel_is_not_chosen_for_runs_the_torch_plan():
    """decode=True, prefill=False: a step with a long prefill chunk gets the torch plan; with
    short_prefill=True a step whose chunks are short gets the kernel."""
    from kvserve.model.attention import AttentionMetadata, StepPlan
    from kvserve.model.attention_native import NativePlan

    b = NativePagedBackend(decode=True, prefill=False)
    shape = (2, 16, 4, 2, 8)
    dec = AttentionMetadata(torch.tensor([3, 7]), [0, 1, 2], [4, 8], [torch.tensor([0]), torch.tensor([1, 2])], 4)
    pre = AttentionMetadata(torch.tensor([3, 6, 7]), [0, 1, 3], [4, 8], [torch.tensor([0]), torch.tensor([1, 2])], 4)
    assert isinstance(b.plan(dec, shape, torch.device("cpu")), NativePlan)
    assert isinstance(b.plan(pre, shape, torch.device("cpu")), StepPlan)
    short = NativePagedBackend(decode=False, prefill=False, short_prefill=True, short_chunk=2)
    assert isinstance(short.plan(pre, shape, torch.device("cpu")), NativePlan)
    assert isinstance(short.plan(dec, shape, torch.device("cpu")), StepPlan)
    # a long band past long_chunk (pre's longest chunk: 2 tokens), the middle band up to it
    long_off = NativePagedBackend(decode=True, prefill=True, long_prefill=False, long_chunk=1)
    assert isinstance(long_off.plan(pre, shape, torch.device("cpu")), StepPlan)
    assert isinstance(long_off.plan(dec, shape, torch.device("cpu")), NativePlan)
    mid_on = NativePagedBackend(decode=True, prefill=True, long_prefill=False, long_chunk=2)
    assert isinstance(mid_on.plan(pre, shape, torch.device("cpu")), NativePlan)
    assert isinstance(NativePagedBackend(long_prefill=False).plan(pre, shape, torch.device("cpu")), NativePlan)


@pytest.mark.skipif(native_module() is None, reason="no native kernel")
def test_the_kernel_path_follows_the_cpu_dtype_and_head_dim(monkeypatch):
    """bf16 at a head_dim that is a multiple of 32 runs bf16-dot exactly where the build has it
    (on AMX tiles where they are usable, unless IMPL 4);
    fp32, fp16 and head_dim 24 the tiled path; IMPL 1 the scalar one. An int8 pool runs int8-dot
    where the build has it (bf16, head_dim a multiple of 32 up to 128, IMPL 0 only)."""
    from kvserve.model import attention_native

    mod = native_module()
    tiled = "tiled" if mod.tiled_available() else "scalar"
    dot = ("bf16_dot_amx" if mod.amx_available() else "bf16_dot") if mod.bf16dot_available() else tiled
    assert attention_native.kernel_path(torch.bfloat16, 64) == dot
    assert attention_native.kernel_path(torch.float32, 64) == tiled
    assert attention_native.kernel_path(torch.float16, 128) == tiled
    assert attention_native.kernel_path(torch.bfloat16, 24) == tiled
    assert attention_native.kernel_path(torch.bfloat16, 64, "int8") == (
        "int8_dot" if mod.int8dot_available() else dot)
    assert attention_native.kernel_path(torch.bfloat16, 160, "int8") == dot
    assert attention_native.kernel_path(torch.float32, 64, "int8") == tiled
    monkeypatch.setattr(attention_native, "IMPL", 3)
    assert attention_native.kernel_path(torch.bfloat16, 64, "int8") == dot
    monkeypatch.setattr(attention_native, "IMPL", 4)
    assert attention_native.kernel_path(torch.bfloat16, 64) == ("bf16_dot" if mod.bf16dot_available() else tiled)
    monkeypatch.setattr(attention_native, "IMPL", 1)
    assert attention_native.kernel_path(torch.bfloat16, 64) == "scalar"
    monkeypatch.setattr(attention_native, "IMPL", 2)
    assert attention_native.kernel_path(torch.bfloat16, 64) == tiled
    bf16 = {**SHAPE, "dtype": torch.bfloat16, "head_dim": 32}
    attention_choice.select_backend("native", **bf16)
    assert recorded()[("attention_native", "all")] == (tiled, "default")


def test_measuring_gives_both_backends_per_role():
    out = attention_choice.measure(**SHAPE)
    assert set(out) == set(attention_choice.ROLES)
    assert all(set(role) == {"torch_sdpa", "native"} and min(role.values()) > 0 for role in out.values())
