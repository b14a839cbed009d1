"""Hardware presets, figures by hand, and this host's measured figures (measured once, cached)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.planner import hardware
from kvserve.planner.presets import hardware_presets


@pytest.mark.parametrize("name", sorted(hardware_presets()))
def test_presets_use_driver_memory_when_known(name: str) -> None:
    e = hardware_presets()[name]
    hw = hardware.from_preset(name)
    if e.get("observed_memory_total_mib"):
        assert hw.memory_bytes == e["observed_memory_total_mib"] * 2**20
    else:
        assert hw.memory_bytes == e["memory_gib"] * 2**30
    assert hw.bandwidth_bytes_s == e["memory_bandwidth_gb_s"] * 1e9


def test_aliases_and_dense_flops() -> None:
    h100 = hardware.from_preset("H100")
    assert h100.key == "h100-sxm-80gb"
    assert h100.memory_bytes == 81559 * 2**20
    assert h100.dense_flops("bfloat16") == 989.5e12
    assert h100.dense_flops("fp8") == 1979e12
    a100 = hardware.from_preset("a100-80")
    assert a100.dense_flops("fp8") == 312e12  # no FP8 units on Ampere: bf16 figure
    assert hardware.from_preset("m2-ultra").dense_flops("bfloat16") is None


def test_unknown_preset_suggests_nearest() -> None:
    with pytest.raises(ValueError, match="did you mean h100-sxm-80gb"):
        hardware.from_preset("h100-sxm-80")


def test_manual_figures_override_a_preset() -> None:
    hw = hardware.resolve_hardware("h100", 40 * 2**30, 1e12, 100.0)
    assert hw is not None
    assert (hw.memory_bytes, hw.bandwidth_bytes_s, hw.dense_flops("bfloat16")) == (40 * 2**30, 1e12, 100e12)
    assert hardware.resolve_hardware(None, None, None, None) is None
    with pytest.raises(ValueError, match="need --memory"):
        hardware.resolve_hardware(None, None, 1e12, None)


def test_cpu_is_measured_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"bw": 0, "mm": 0}

    def fake_bw() -> float:
        calls["bw"] += 1
        return 12.5e9

    def fake_mm() -> float:
        calls["mm"] += 1
        return 50e9

    monkeypatch.setattr(hardware, "measure_bandwidth", fake_bw)
    monkeypatch.setattr(hardware, "measure_matmul_flops", fake_mm)
    first = hardware.this_cpu()
    second = hardware.this_cpu()
    assert calls == {"bw": 1, "mm": 1}
    assert first.bandwidth_bytes_s == second.bandwidth_bytes_s == 12.5e9
    assert first.memory_bytes > 0 and first.key == "cpu"
    cache = json.loads((hardware.cache_dir() / "cpu.json").read_text())
    assert next(iter(cache.values()))["bandwidth_bytes_s"] == 12.5e9
    hardware.this_cpu(refresh=True)
    assert calls["bw"] == 2


def test_real_measurements_are_plausible() -> None:
    bw = hardware.measure_bandwidth(nbytes=8 * 2**20, repeats=2)
    flops = hardware.measure_matmul_flops(n=128, repeats=2)
    assert 1e8 < bw < 1e13
    assert 1e6 < flops < 1e14
