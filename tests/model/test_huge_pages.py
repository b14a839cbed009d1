"""Buffers on transparent huge pages (kvserve/model/huge_pages.py): the shape and dtype asked for,
usable memory, the interior advised to the kernel, small buffers and a switched-off run plain."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.model import huge_pages as hp


def vmstat(*keys: str) -> int:
    values = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    return sum(int(values.get(k, 0)) for k in keys)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_a_buffer_is_what_was_asked_for_and_holds_values(dtype: torch.dtype) -> None:
    shape = (3, hp.HUGE_PAGE // 2 + 5)  # past one huge page, not a multiple of it
    t = hp.empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    src = torch.arange(t.numel()).reshape(shape).to(dtype)
    t.copy_(src)
    assert torch.equal(t, src)
    if hp.enabled():
        assert t.data_ptr() % hp.HUGE_PAGE == 0  # the interior starts on a huge page boundary


def test_small_buffers_and_a_switched_off_run_are_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    small = hp.empty((100,), torch.float32)
    assert small.shape == (100,)
    monkeypatch.setenv("KVSERVE_HUGE_PAGES", "0")
    assert not hp.enabled()
    t = hp.empty((4 * hp.HUGE_PAGE,), torch.uint8)
    assert t.shape == (4 * hp.HUGE_PAGE,) and t.is_contiguous()


def test_thp_mode_reads_the_bracketed_word(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hp.thp_mode(f) == "madvise"
    assert hp.thp_mode(tmp_path / "absent") == "none"


@pytest.mark.skipif(not hp.enabled() or not Path("/proc/vmstat").exists(), reason="no THP here")
def test_touching_the_interior_faults_in_huge_pages() -> None:
    """The kernel tries a huge page for each touched 2 MiB of the interior (allocated, or fallen
    back when memory is fragmented): the advice took."""
    before = vmstat("thp_fault_alloc", "thp_fault_fallback")
    t = hp.empty((8 * hp.HUGE_PAGE,), torch.uint8)
    t.fill_(1)
    assert vmstat("thp_fault_alloc", "thp_fault_fallback") - before >= 4


def test_checkpoint_tensors_are_read_onto_huge_pages(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from kvserve.model.safetensors_read import read_tensors

    big = torch.randn(1024, 1536).to(torch.bfloat16)  # 3 MiB
    small = torch.randn(7, 3)
    save_file({"big": big, "small": small}, str(tmp_path / "m.safetensors"))
    got = dict(read_tensors(tmp_path / "m.safetensors"))
    assert torch.equal(got["big"], big) and torch.equal(got["small"], small)
    if hp.enabled():
        assert got["big"].data_ptr() % hp.HUGE_PAGE == 0


@pytest.mark.parametrize("pool", ["bfloat16", "int8", "k:int8,v:int4"])
def test_the_kv_pool_is_on_huge_pages_and_plain_when_switched_off(pool: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer's pool tensor (the float pool, a codec pool's shared plane, a pool whose K and V
    regions differ in size) starts on a huge page boundary where huge pages may be; with
    ``KVSERVE_HUGE_PAGES=0`` the pool is an ordinary allocation, and either holds what is written."""
    from kvserve.kv.quant import parse_kv_codecs
    from kvserve.kv.storage import KVStorage

    def storage() -> KVStorage:
        return KVStorage(num_layers=2, num_blocks=2048, block_size=16, kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                         pool=parse_kv_codecs(pool, "bfloat16"), group_size=16)

    s = storage()
    assert s._bufs and all(b.numel() * b.element_size() >= hp.MIN_BYTES for b in s._bufs)
    if hp.enabled():
        assert all(b.data_ptr() % hp.HUGE_PAGE == 0 for b in s._bufs)
    for b in s._bufs:
        b.fill_(7)
        assert float(b.reshape(-1)[-1]) == 7
    monkeypatch.setenv("KVSERVE_HUGE_PAGES", "0")
    off = storage()
    assert [b.shape for b in off._bufs] == [b.shape for b in s._bufs]
    assert any(b.data_ptr() % hp.HUGE_PAGE != 0 for b in off._bufs) or not hp.enabled()
