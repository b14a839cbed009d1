"""A saved block is self-describing: exported from one pool block and imported into another (or
into a fresh storage of the same layout, or through msgpack), it reads back exactly; a partial int4
block with unencoded keys is refused; save/load without a tier are refused by name."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvserve.contract import BlockNotSealed, BlockPayload, LoadBlock, NoTierConfigured, SaveBlock
from kvserve.kv.block_io import export_block, import_block
from tests.quant.test_storage import Driver, make_storage


def read(storage, block: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.stack([layer.gather_blocks(torch.tensor([block])) for layer in storage._layers])


@pytest.mark.parametrize("codec", ["float32", "int8", "fp8", "k:int8,v:int4"])
def test_export_import_round_trip_into_another_storage(codec: str) -> None:
    src = make_storage(codec, window=4)
    d = Driver(src, seed=3)
    seq = d.new_seq(8)
    d.step([(seq, 8)])  # two full blocks
    payload = msgspec.msgpack.decode(msgspec.msgpack.encode(export_block(src, seq.table[1])), type=BlockPayload)
    assert payload.codec == src.pairs[0].spec.name and payload.num_tokens == 4
    dst = make_storage(codec, window=4)
    import_block(dst, payload, 7)
    dst.check()
    assert torch.equal(read(dst, 7), read(src, seq.table[1]))


def test_a_partial_int4_block_is_refused_until_sealed() -> None:
    s = make_storage("int4", window=4)
    d = Driver(s, seed=4)
    seq = d.new_seq(8)
    d.step([(seq, 6)])  # block 1 holds 2 of 4 tokens: its key group is not encoded yet
    export_block(s, seq.table[0])  # the full block is fine
    with pytest.raises(BlockNotSealed):
        export_block(s, seq.table[1])


def test_a_payload_of_another_layout_is_refused() -> None:
    s = make_storage("int8")
    d = Driver(s, seed=5)
    seq = d.new_seq(4)
    d.step([(seq, 4)])
    other = make_storage("int8", layers=3)
    with pytest.raises(ValueError, match="layout"):
        import_block(other, export_block(s, seq.table[0]), 0)


def test_save_and_load_need_a_tier() -> None:
    s = make_storage("int8")
    with pytest.raises(NoTierConfigured, match="SaveBlock"):
        s.run_block_ops([SaveBlock(0, b"k")])
    with pytest.raises(NoTierConfigured, match="LoadBlock"):
        s.run_block_ops([LoadBlock(b"k", 0)])
