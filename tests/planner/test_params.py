"""Parameter counts from the shape equal the reference data (published checkpoint counts)."""

from __future__ import annotations

import pytest

from kvserve.planner.loader import load_model
from kvserve.planner.params import count_parameters, weights_bytes, weights_read_per_step
from kvserve.planner.presets import model_presets


@pytest.mark.parametrize("name", sorted(model_presets()))
def test_counts_equal_reference(name: str) -> None:
    ref = model_presets()[name]["parameters"]
    p = count_parameters(load_model(name))
    assert p.total == ref["total"]
    assert p.embedding == ref["embedding"]
    assert p.active == ref.get("active", ref["total"])


def test_weights_bytes_by_dtype() -> None:
    assert weights_bytes(8_030_261_248, "bfloat16") == 16_060_522_496
    assert weights_bytes(10, "fp8") == 10
    assert weights_bytes(1280, "int4") == 640 + 20  # 4 bits + an fp16 scale per 128 weights


def test_moe_weights_read_grow_from_active_to_total() -> None:
    spec = load_model("mixtral-8x7b")
    p = count_parameters(spec)
    assert weights_read_per_step(p, spec, 1) == pytest.approx(p.active)
    reads = [weights_read_per_step(p, spec, b) for b in (1, 2, 8, 64)]
    assert reads == sorted(reads)
    assert reads[-1] == pytest.approx(p.total, rel=1e-3)
    dense = load_model("llama-3-8b")
    assert weights_read_per_step(count_parameters(dense), dense, 32) == count_parameters(dense).total
