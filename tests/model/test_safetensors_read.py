"""Reading safetensors without mapping the file gives exactly what safe_open gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvserve.model.safetensors_read import read_tensors


def _same_as_safe_open(path: Path) -> dict[str, torch.Tensor]:
    got = dict(read_tensors(path))
    with safe_open(str(path), framework="pt", device="cpu") as f:
        want = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    assert got.keys() == want.keys()
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    return got


def test_every_dtype_and_shape_reads_back_exactly(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {"w.bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
               "w.f16": torch.randn(3, 2, 4, generator=g).to(torch.float16),
               "a.f32": torch.randn(9, generator=g), "ids": torch.arange(6, dtype=torch.int64),
               "empty": torch.zeros(0, 4), "flag": torch.tensor([True, False])}
    save_file(tensors, tmp_path / "m.safetensors", metadata={"format": "pt"})
    got = _same_as_safe_open(tmp_path / "m.safetensors")
    got["a.f32"][0] = 123.0  # each tensor owns its memory: writable, the file untouched
    assert dict(read_tensors(tmp_path / "m.safetensors"))["a.f32"][0] != 123.0


def test_a_dtype_it_does_not_know_goes_through_safe_open(tmp_path: Path) -> None:
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no fp8 dtype in this torch")
    save_file({"q": torch.ones(4).to(torch.float8_e4m3fn), "s": torch.ones(2)}, tmp_path / "q.safetensors")
    _same_as_safe_open(tmp_path / "q.safetensors")


def test_a_truncated_file_is_an_error(tmp_path: Path) -> None:
    save_file({"w": torch.ones(1000)}, tmp_path / "t.safetensors")
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="truncated"):
        list(read_tensors(tmp_path / "t.safetensors"))
