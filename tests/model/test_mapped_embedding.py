"""Once the logits projection is packed, the embedding is read in place from the checkpoint file
(one resident copy of the vocab x hidden matrix, not two) and nothing else keeps the mapping that
loading read whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvserve.model.cpu_gemm import PackedFp16Linear, fbgemm_fp16_available
from kvserve.model.loader import load_model, weight_files
from kvserve.model.mapped_tensor import map_tensor

from .helpers import build_hf_model

pytestmark = pytest.mark.skipif(not fbgemm_fp16_available(), reason="no FBGEMM in this torch build")


def mapped_files(t: torch.Tensor) -> set[str]:
    """Paths of the file mappings that hold ``t``'s data (Linux /proc/self/maps)."""
    ptr = t.untyped_storage().data_ptr()
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi and len(parts) >= 6:
            found.add(parts[5])
    return found


@pytest.fixture(scope="module")
def tied_bf16(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tied-bf16")
    build_hf_model("qwen2-bias-tied").to(torch.bfloat16).save_pretrained(out)
    return out


def test_map_tensor_equals_the_stored_tensor_and_refuses_a_cast(tied_bf16):
    files = weight_files(tied_bf16)
    with safe_open(str(files[0]), framework="pt") as f:
        stored = f.get_tensor("model.embed_tokens.weight")
    mapped = map_tensor(files, "model.embed_tokens.weight", torch.bfloat16)
    assert mapped is not None and torch.equal(mapped, stored)
    assert map_tensor(files, "model.embed_tokens.weight", torch.float16) is None
    assert map_tensor(files, "no.such.tensor", torch.bfloat16) is None


def test_packed_tied_model_reads_its_embedding_from_the_file(tied_bf16):
    model, _ = load_model(tied_bf16, dtype="bfloat16", cpu_fp16_gemm=True)  # packed on any CPU
    emb = model.model.embed_tokens.weight
    assert isinstance(model.lm_head, PackedFp16Linear)
    assert str(weight_files(tied_bf16)[0]) in mapped_files(emb)
    with safe_open(str(weight_files(tied_bf16)[0]), framework="pt") as f:
        stored = f.get_tensor("model.embed_tokens.weight")
    ids = torch.tensor([3, 17, 5, 60, 3])
    assert torch.equal(model.model.embed_tokens(ids), stored[ids])
    # nothing else still points into a mapping of the file: the one that loading read whole is gone
    others = [n for n, p in model.named_parameters() if p is not emb and str(weight_files(tied_bf16)[0]) in mapped_files(p)]
    assert others == []


def test_an_untied_packed_model_maps_its_embedding_too(tmp_path):
    build_hf_model("llama-gqa").to(torch.bfloat16).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, dtype="bfloat16", cpu_fp16_gemm=True)
    file = str(weight_files(tmp_path)[0])
    assert file in mapped_files(model.model.embed_tokens.weight)
    assert isinstance(model.lm_head, PackedFp16Linear)
    assert [n for n, p in model.named_parameters() if file in mapped_files(p)] == ["model.embed_tokens.weight"]


def test_a_float32_load_keeps_its_own_embedding(tied_bf16):
    model, _ = load_model(tied_bf16, dtype="float32")  # a cast: nothing to map, nothing packed
    assert str(weight_files(tied_bf16)[0]) not in mapped_files(model.model.embed_tokens.weight)
