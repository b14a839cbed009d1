"""Tensor-parallel ranks run the kernels a single engine would choose for their shard's shapes:
each shard's projections take the GEMM plan's paths (no logits projection off rank 0), every rank
runs rank 0's plan and attention backend, and rank 0's choices reach the parent's /metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve import LLM, SamplingParams
from kvserve.model.cpu_gemm import PackedFp16Linear, PackedFp16MLP, fbgemm_fp16_available
from kvserve.model.gemm_plan import uniform
from kvserve.native import choices as kernel_choices
from kvserve.parallel.load import load_shard
from tests.parallel.conftest import KW, PROMPTS

needs_fbgemm = pytest.mark.skipif(not fbgemm_fp16_available(), reason="this torch build has no FBGEMM fp16")


def _noop(t: torch.Tensor) -> None:
    pass


@needs_fbgemm
@pytest.mark.parametrize("name", ["qwen2-tied", "llama-gqa-bias"])
def test_a_shard_takes_its_plans_paths(models: dict[str, Path], name: str) -> None:
    packed = uniform("fbgemm_fp16_x1", "forced")
    for rank in (0, 1):
        model, _ = load_shard(models[name], rank, 2, _noop, "bfloat16", plan=packed)
        layer = model.model.layers[0]
        assert isinstance(layer.self_attn.inner.qkv_proj, PackedFp16Linear)
        assert isinstance(layer.self_attn.inner.o_proj, PackedFp16Linear)
        assert isinstance(layer.mlp.inner, PackedFp16MLP)
        # the logits: packed on rank 0 (a copy of the tied embedding), none at all elsewhere
        assert isinstance(model.lm_head, PackedFp16Linear) if rank == 0 else model.lm_head is None
        model, _ = load_shard(models[name], rank, 2, _noop, "bfloat16", plan=uniform("native", "forced"))
        assert isinstance(model.model.layers[0].self_attn.inner.qkv_proj, nn.Linear)


def _by_key(choices: list[kernel_choices.KernelChoice], prefix: str) -> dict[tuple[str, str], tuple[str, str]]:
    return {(c.role, c.band): (c.choice, c.source) for c in choices if c.role.startswith(prefix)}


@pytest.mark.parametrize("attention", ["auto", "native"])
def test_every_rank_runs_rank_0s_kernels(models: dict[str, Path], attention: str) -> None:
    kernel_choices.clear()
    kw = {**KW, "dtype": "bfloat16", "attention_backend": attention}
    with LLM(str(models["llama-gqa-bias"]), kv_cache_memory="1MiB", tensor_parallel_size=2, **kw) as llm:
        out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        rank0, rank1 = llm.engine.runner.worker_kernel_choices
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    gemm0, gemm1 = _by_key(rank0, "gemm_"), _by_key(rank1, "gemm_")
    assert {role for role, _ in gemm0} == {"gemm_qkv", "gemm_o", "gemm_mlp", "gemm_lm_head"}
    assert {k: v for k, v in gemm1.items() if k[0] != "gemm_lm_head"} == \
        {k: v for k, v in gemm0.items() if k[0] != "gemm_lm_head"}
    assert {v[0] for k, v in gemm1.items() if k[0] == "gemm_lm_head"} == {"native"}  # no logits on rank 1
    attn0 = _by_key(rank0, "attention")
    bands = {k: v for k, v in attn0.items() if k[0] != "attention_native"}  # the 4 bands; + the kernel paths (bf16, int8 KV)
    assert len(bands) == 4 and len(attn0) in (4, 6) and _by_key(rank1, "attention") == attn0
    if attention == "native":
        assert {v[1] for v in bands.values()} <= {"forced", "fallback"}
    # rank 0's choices are this process's too: the process runner's /metrics path
    assert _by_key(kernel_choices.choices(), "") == _by_key(rank0, "")
